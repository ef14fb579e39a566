// `kvbridge demo`: the P/D demo with real processes (demo.h). Options choose
// the preset, each side's TP size, block sizes and order, the number of decode
// instances, the transport, the failure policy, and a fault to inject.
#include "cli.h"
#include "demo.h"

namespace kvbridge::cli {
namespace {

void add_side(CLI::App* app, const std::string& name, demo::SideArgs& s) {
  app->add_option("--" + name + "-tp", s.tp, "TP size of the " + name + " instance")->capture_default_str();
  app->add_option("--" + name + "-pp", s.pp,
                  "pipeline stages of the " + name + " instance (each rank holds its stage's layers)")
      ->capture_default_str();
  app->add_option("--" + name + "-dcp", s.dcp,
                  "context-parallel size of the " + name + " instance (attention tokens dealt over that many TP ranks)")
      ->capture_default_str();
  app->add_option("--" + name + "-dcp-interleave", s.dcp_interleave, "tokens per chunk dealt to one context shard")
      ->capture_default_str();
  app->add_option("--" + name + "-block-tokens", s.block_tokens,
                  name + " logical block tokens (0: preset default; qwen3-next's default run: " +
                      (name == "prefill" ? "64" : "128") + ")")
      ->capture_default_str();
  app->add_option("--" + name + "-kernel-block-tokens", s.kernel_block_tokens,
                  name + " kernel block tokens (0: preset default)")
      ->capture_default_str();
  app->add_option("--" + name + "-order", s.order, name + " order: LBHNC, LBNHC or BLHNC")->capture_default_str();
  app->add_option("--" + name + "-netns", s.netns, "run the " + name + " ranks in this network namespace (root)");
  app->add_option("--" + name + "-host", s.host, "address the " + name + " ranks listen on")->capture_default_str();
}

}  // namespace

Command add_demo_command(CLI::App& root) {
  auto args = std::make_shared<demo::DemoArgs>();
  auto inject = std::make_shared<std::string>("none");
  auto lease_ms = std::make_shared<uint64_t>(0);
  auto timeout_ms = std::make_shared<uint64_t>(0);
  CLI::App* app = root.add_subcommand(
      "demo", "Prefill and decode instances as real processes: requests pulled, verified byte-exact, reported");
  app->add_option("--preset", args->preset, "Preset (see `kvbridge presets`)")->capture_default_str();
  add_side(app, "prefill", args->prefill);
  add_side(app, "decode", args->decode);
  app->add_option("--decode-instances", args->decode_instances, "Decode instances pulling from the prefill instance")
      ->check(positive())
      ->capture_default_str();
  app->add_option("--requests", args->requests, "Number of requests")->check(positive())->capture_default_str();
  app->add_option("--max-tokens", args->max_tokens, "Longest request in tokens (0: chosen from the block sizes)");
  app->add_option("--min-tokens", args->min_tokens, "Shortest request in tokens (lengths are uniform in between)")
      ->check(positive())
      ->capture_default_str();
  app->add_option("--num-blocks", args->num_blocks,
                  "Blocks of the KV groups on each side (0: enough for one request; state groups with tensors "
                  "of their own get a slot per request)");
  app->add_option("--seed", args->seed, "Seed of the request generator")->capture_default_str();
  app->add_option("--transport", args->transport,
                  "cma, tcp or ucx; with --memory cuda: cuda_ipc (the default) or tcp, staged")
      ->check(CLI::IsMember({"cma", "tcp", "ucx", "cuda_ipc"}))
      ->capture_default_str();
  app->add_option("--memory", args->memory,
                  "host, or cuda: the KV in GPU memory of this host (ranks share GPUs when there are fewer), over "
                  "cuda_ipc")
      ->check(CLI::IsMember({"host", "cuda"}))
      ->capture_default_str();
  app->add_option("--policy", args->policy, "On a failed load: fail or recompute")
      ->check(CLI::IsMember({"fail", "recompute"}))
      ->capture_default_str();
  auto secret_file = std::make_shared<std::string>();
  app->add_option("--secret-file", *secret_file,
                  "File holding the shared secret of every channel (default: $KVBRIDGE_SECRET, if set)");
  app->add_option("--inject", *inject, "Fault to inject: " + demo::inject_names())
      ->check(CLI::Validator(
          [](std::string& v) {
            Result<demo::Inject> i = demo::parse_inject(v);
            return i.ok() ? std::string() : i.error().message();
          },
          "FAULT"))
      ->capture_default_str();
  app->add_option("--lease-ms", *lease_ms, "Prefill lease (default 30000; 1500 with --inject)");
  auto after_ms = std::make_shared<uint64_t>(40);
  app->add_option("--inject-after-ms", *after_ms, "kill-prefill, kill-decode, abort: how long after the load starts")
      ->capture_default_str();
  app->add_option("--transfer-timeout-ms", *timeout_ms,
                  "Deadline of each load (default 20000; 500 with --inject stall)");
  app->add_option("--flood", args->flood,
                  "Idle connections to each listener of each prefill rank during the first half of the requests");
  app->add_option("--chunk-tokens", args->chunk_tokens,
                  "Loads in token-ordered chunks of about this many tokens (0: one per load); a failed load "
                  "recomputes from its first chunk that did not arrive whole (a streamed load is cut by layers "
                  "only)")
      ->capture_default_str();
  app->add_option("--stream", args->stream,
                  "Layer-wise streaming: off, layer (every request) or auto (requests of --stream-min-tokens and "
                  "more); each request then runs again unstreamed as the baseline")
      ->check(CLI::IsMember({"off", "layer", "auto"}))
      ->capture_default_str();
  app->add_option("--mode", args->mode,
                  "Who moves the bytes: pull (decode ranks read) or push (prefill ranks write into the decode "
                  "ranks' blocks)")
      ->check(CLI::IsMember({"pull", "push"}))
      ->capture_default_str();
  app->add_option("--layers-per-stage", args->layers_per_stage, "Streamed loads: consecutive layers per stage")
      ->check(positive())
      ->capture_default_str();
  app->add_option(
      "--stream-min-tokens", args->stream_min_tokens,
      "--stream auto: the smallest request that streams (0: " + std::to_string(demo::kAutoStreamTokens) + ")");
  app->add_option("--compute-us-per-layer", args->compute_us_per_layer,
                  "Prefill time per layer in microseconds: the layer's KV write, then a busy loop for the rest, before "
                  "the layer is saved")
      ->capture_default_str();
  app->add_option("--producer-delay-us", args->producer_delay_us,
                  "--memory cuda with --stream: each layer's device write waits behind a kernel of this many "
                  "microseconds and is announced at once, so the decode ranks' copies must wait for its event")
      ->capture_default_str();
  app->add_option("--etcd", args->etcd,
                  "Find the prefill instance through etcd at this client URL (http://host:port): prefill rank 0 "
                  "registers it, decode ranks watch for it");
  app->add_flag("--pin-cores", args->pin_cores,
                "Pin each rank process to its own core (round-robin over this process's cores), as each rank of a "
                "deployment has its own GPU and NIC: an idle rank's core then does not speed up another's transfer");
  app->add_flag("--verify-plans", args->verify_plans, "Decode ranks check every plan with the verifier before it runs");
  app->add_flag("--verify-content", args->verify_content,
                "Every byte moved is hashed (xxh3) at its source and where it landed; a load whose bytes differ "
                "fails (host memory)");
  app->add_flag("--json", args->json, "Print one JSON object instead of the table");
  app->add_flag("!--no-progress", args->progress, "No progress bar");
  return {app, [app, args, inject, lease_ms, timeout_ms, secret_file, after_ms] {
            args->inject_after = std::chrono::milliseconds(*after_ms);
            Result<std::string> secret = read_secret(*secret_file);
            if (!secret.ok()) return fail(secret.error());
            args->secret = std::move(*secret);
#if !KVB_HAVE_DISCOVERY
            if (!args->etcd.empty()) {
              return fail(
                  Status::unavailable("--etcd: this kvbridge was built without discovery (libcurl was not found: "
                                      "install libcurl4-openssl-dev and build again)"));
            }
#endif
            // The default run shows different block sizes on the two sides.
            const bool blocks_given =
                app->get_option("--prefill-block-tokens")->count() + app->get_option("--decode-block-tokens")->count() >
                0;
            if (args->preset == "qwen3-next" && !blocks_given) {
              args->prefill.block_tokens = 64;
              args->decode.block_tokens = 128;
            }
            if (args->memory == "cuda") {
              const bool given = app->get_option("--transport")->count() > 0;
              if (given && args->transport != "cuda_ipc" && args->transport != "tcp") {
                return fail(Status::invalid_argument(
                    "--memory cuda moves device memory over cuda_ipc (one host) or tcp (staged through pinned host "
                    "memory), not " +
                    args->transport));
              }
              if (!given) args->transport = "cuda_ipc";
            } else if (args->transport == "cuda_ipc") {
              return fail(Status::invalid_argument("--transport cuda_ipc moves device memory: add --memory cuda"));
            }
            Result<demo::Inject> i = demo::parse_inject(*inject);
            if (!i.ok()) return fail(i.error());
            args->inject = *i;
            const bool injecting = *i != demo::Inject::kNone;
            args->lease = std::chrono::milliseconds(*lease_ms ? *lease_ms : injecting ? 1500 : 30000);
            args->transfer_timeout = std::chrono::milliseconds(*timeout_ms                  ? *timeout_ms
                                                               : *i == demo::Inject::kStall ? 500
                                                                                            : 20000);
            return demo::run(*args);
          }};
}

}  // namespace kvbridge::cli
