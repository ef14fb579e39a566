#!/usr/bin/env bash
# Runs a command and prints how long it took, as "time: NAME M min S s" (also
# when it fails, with its exit status), so that a long run such as `make
# test` shows where its time goes.
# Usage: scripts/timed.sh NAME COMMAND [ARGS...]
name=${1:?name}
shift
start=$SECONDS
"$@"
rc=$?
took=$((SECONDS - start))
echo "time: $name $((took / 60)) min $((took % 60)) s$([[ $rc -ne 0 ]] && echo " (failed, exit $rc)")"
exit $rc
