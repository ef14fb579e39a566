"""What a router or client can and cannot do with kv_transfer_params: under the deployment's
secret the prefill signs each hand-off (instance, addresses, incarnations, request id, block
ids, token count), so params changed on the way steer nothing; a hand-off is loaded by one
request only; and values out of range are kvbridge errors, never other exceptions."""
import copy
import pickle

import pytest

import kvbridge
from test_connector_v1 import Instance, prefill_request

SECRET = "one-deployment-secret-0123456789"


@pytest.fixture
def signed():
    made = []

    def make(secret=SECRET, **extra):
        p = Instance("prefill", "prefill", 1, 16, secret=secret, **extra)
        d = Instance("decode", "decode", 2, 32, secret=secret, **extra)
        made.extend([p, d])
        return p, d

    yield make
    for inst in made:
        inst.close()


def no_load_queued(d):
    meta = d.scheduler.build_connector_meta()
    assert meta.loads == [], meta.loads


def test_params_changed_on_the_way_steer_nothing(signed):
    """The attack: a crafted request names another request's blocks (or request id, addresses,
    a token count) to read its KV and send "done" for it. Each change is refused by name before
    anything is read, the victim's blocks stay held, and its own load lands byte-exact."""
    p, d = signed()
    prompt = list(range(100, 140))
    victim = prefill_request(p, "victim", prompt, [3, 4, 5], seed=11)
    other = prefill_request(p, "other", prompt, [6, 7, 8], seed=22)
    assert "remote_mac" in victim and "remote_mac" in other
    forgeries = {
        "another request's blocks": dict(other, remote_block_ids=victim["remote_block_ids"]),
        "another request's id": dict(other, remote_request_id="victim"),
        "fewer tokens": dict(victim, remote_num_tokens=16),
        "other addresses": dict(victim, remote_addresses=["127.0.0.1:1"]),
        "no mac": {k: v for k, v in victim.items() if k != "remote_mac"},
        "a mac of other params": dict(victim, remote_mac=other["remote_mac"]),
    }
    for what, params in forgeries.items():
        with pytest.raises(kvbridge.PermissionDenied, match="remote_mac") as e:
            d.scheduler.get_num_new_matched_tokens(f"crafted-{len(what)}", prompt, 0, pickle.loads(pickle.dumps(params)))
        assert "crafted" in str(e.value), what
    no_load_queued(d)
    assert p.scheduler.held == 2, "nothing was read, so nothing was released"

    assert d.scheduler.get_num_new_matched_tokens("victim", prompt, 0, pickle.loads(pickle.dumps(victim))) == (40, True)
    d.scheduler.update_state_after_alloc("victim", [6, 2], 40)
    seen = d.run_until(lambda f: "victim" in f.finished_recving)
    assert seen.outcomes["victim"].outcome == "finished", seen.outcomes["victim"].error
    d.check([6, 2], 40, seed=11)
    p.run_until(lambda f: "victim" in f.finished_sending)
    assert p.scheduler.held == 1


def test_a_hand_off_is_loaded_by_one_request(signed):
    """Params seen elsewhere and replayed verbatim under another request id: refused, naming
    the request that loads them; the same request asking again (the engine retries the
    allocation) is not a replay."""
    p, d = signed()
    prompt = list(range(40))
    params = prefill_request(p, "req-1", prompt, [3, 4, 5], seed=5)
    assert d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, copy.deepcopy(params)) == (40, True)
    assert d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, copy.deepcopy(params)) == (40, True)
    with pytest.raises(kvbridge.PermissionDenied, match="is request 'req-1''s, loaded already"):
        d.scheduler.get_num_new_matched_tokens("replay", prompt, 0, copy.deepcopy(params))
    d.scheduler.update_state_after_alloc("req-1", [0, 1], 40)
    seen = d.run_until(lambda f: "req-1" in f.finished_recving)
    assert seen.outcomes["req-1"].outcome == "finished", seen.outcomes["req-1"].error
    d.check([0, 1], 40, seed=5)


def test_without_a_secret_params_are_taken_as_given(signed):
    """No secret, nothing signed: what binds a hand-off then is only the prefill's own checks
    (docs/security.md says so). The params carry no mac and load."""
    p, d = signed(secret="")
    prompt = list(range(40))
    params = prefill_request(p, "req-1", prompt, [3, 4, 5], seed=5)
    assert "remote_mac" not in params
    assert d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, params) == (40, True)


def test_without_a_secret_a_reader_is_served_only_the_blocks_handed_off_for_its_request(signed):
    """No secret, params taken as given: a crafted request that names another request's blocks
    under its own hand-off reads nothing of them over tcp, where the prefill serves a reader
    only the blocks handed off for the request it heartbeats (read grants). The crafted load
    fails naming why; the victim's own load then lands byte-exact."""
    p, d = signed(secret="", transports=("tcp",), load_timeout_s=1.5)
    prompt = list(range(100, 140))
    victim = prefill_request(p, "victim", prompt, [3, 4, 5], seed=11)
    other = prefill_request(p, "other", prompt, [6, 7, 8], seed=22)
    crafted = dict(other, remote_block_ids=victim["remote_block_ids"])
    assert d.scheduler.get_num_new_matched_tokens("crafted", prompt, 0, crafted) == (40, True)
    d.scheduler.update_state_after_alloc("crafted", [0, 1], 40)
    seen = d.run_until(lambda f: "crafted" in f.finished_recving, also=[p])
    outcome = seen.outcomes["crafted"]
    assert outcome.outcome == "failed", "a read of blocks not handed off for the request was served"
    assert "not inside a read grant" in str(outcome.error), outcome.error
    assert d.scheduler.get_num_new_matched_tokens("victim", prompt, 0, victim) == (40, True)
    d.scheduler.update_state_after_alloc("victim", [6, 2], 40)
    seen = d.run_until(lambda f: "victim" in f.finished_recving, also=[p])
    assert seen.outcomes["victim"].outcome == "finished", seen.outcomes["victim"].error
    d.check([6, 2], 40, seed=11)


@pytest.mark.parametrize("change", [
    {"remote_block_ids": [2**63]},
    {"remote_block_ids": [-7]},
    {"remote_block_ids": "3,4"},
    {"remote_request_id": "a b"},
    {"remote_num_tokens": -5},
    {"remote_num_tokens": 10**12},
    {"remote_num_tokens": 4.5},
    {"remote_instance": ""},
    {"remote_addresses": "127.0.0.1:1"},
    {"remote_incarnations": ["nothex"]},
    {"remote_tp_size": object()},
])
def test_values_out_of_range_are_kvbridge_errors(signed, change):
    """A crafted value never raises anything but a kvbridge error out of the engine's hook, and
    never reaches the engine as a token count."""
    p, d = signed()
    prompt = list(range(40))
    params = dict(prefill_request(p, "req-1", prompt, [3, 4, 5], seed=5), **change)
    with pytest.raises(kvbridge.Error):
        d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, params)
    no_load_queued(d)
