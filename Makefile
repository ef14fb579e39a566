# kvbridge: the two commands are `make demo` and `make test`. Each installs
# missing Debian packages (as root), configures, builds and runs.

BUILD       ?= build
BUILD_ASAN  ?= build-asan
BUILD_FUZZ  ?= build-fuzz
BUILD_TSAN  ?= build-tsan
JOBS        ?= $(shell nproc)
FUZZ_SECONDS ?= 60
CMAKE_FLAGS ?=
# The optimised builds (main, TSan, fuzz) keep line tables only: enough for
# backtraces and sanitizer reports. A heavy source compiles a third faster;
# the whole main build, about 3% faster.
OPT_FLAGS   := '-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG'

.PHONY: all deps build demo demo-engine engine-matrix test check test-asan test-tsan fuzz fuzz-short bench clean install-python gpu-bundle

all: build

deps:
	@scripts/deps.sh

$(BUILD)/build.ninja: CMakeLists.txt | deps
	cmake -G Ninja -S . -B $(BUILD) $(OPT_FLAGS) $(CMAKE_FLAGS)

build: deps $(BUILD)/build.ninja
	scripts/timed.sh build cmake --build $(BUILD) -j $(JOBS)

# The main job: builds only the CLI (the demo's ranks are the same binary).
demo: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target kvbridge
	$(BUILD)/tools/kvbridge demo

# The reference engine: a hybrid model (linear-attention state, ring buffer,
# attention every 4th layer) served P/D through kvbridge.connector_v1, prefill
# TP 2 with 16-token blocks, decode TP 4 with 32-token blocks, its output
# compared bit for bit with a colocated run; then again streamed (decode reads
# each layer as prefill saves it), with TTFT with and without streaming.
demo-engine: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target kvbridge_python
	PYTHONPATH=$(BUILD)/python /usr/bin/python3 examples/mini_engine/engine.py --model hybrid \
	  --prefill-tp 2 --decode-tp 4 --prefill-block 16 --decode-block 32 --stream layer

# The reference engine's whole matrix (make test runs a sample of it): every
# model, TP pair of {1,2,4} x {1,2,4}, block sizes, cache orders and chunking.
engine-matrix: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS) --target kvbridge_python
	KVB_ENGINE_MATRIX=full PYTHONPATH=$(BUILD)/python KVB_EXAMPLES=$(CURDIR)/examples /usr/bin/python3 -m pytest \
	  -q -p no:cacheprovider python/tests/test_mini_engine.py -k bit_for_bit

# Every test: `check`, then the tests again under ASan/UBSan and the threaded
# ones under TSan (what CI runs, with KVB_REQUIRE set: .ci/run). The main
# build compiles and links the CUDA code (when the toolkit is there); the
# sanitizer builds test everything above the device seam on the host fake
# without it (the CUDA runtime is not instrumented).
test:
	@scripts/timed.sh check $(MAKE) --no-print-directory check
	@scripts/timed.sh test-asan $(MAKE) --no-print-directory test-asan
	@scripts/timed.sh test-tsan $(MAKE) --no-print-directory test-tsan

# The tests of the main build: unit, property, matrix, conformance, attack,
# CLI, demo, Python, and a short run of every fuzz target.
# glibc's malloc in transparent huge pages (glibc.malloc.hugetlb=1, glibc
# 2.35 and later; older ones ignore it): the tests allocate and free large
# buffers over and over, each page faulted in anew, and on a virtual machine
# a fault costs far more than the page: the planner's pipeline and context
# tests took 22 s with 785,000 page faults, 12.7 s with 3,460.
TEST_MALLOC := GLIBC_TUNABLES=glibc.malloc.hugetlb=1

# A limit for every test that sets none of its own (ctest has none by
# default): a test that hangs fails by name instead of holding the run until
# CI's own limit. Over ten times the slowest such test here (plan_matrix_test,
# 46 s); the sanitizer builds run several times slower.
TEST_TIMEOUT := 600
SANITIZED_TEST_TIMEOUT := 1200

check: build
	$(TEST_MALLOC) scripts/timed.sh "check: tests" ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) --timeout $(TEST_TIMEOUT)
	scripts/timed.sh "check: fuzz-short" $(MAKE) --no-print-directory fuzz-short

# Debug with line tables only (-g1), as the optimised builds: enough for
# ASan's and UBSan's reports, and the build took 10 of CI's minutes with -g.
$(BUILD_ASAN)/build.ninja: CMakeLists.txt | deps
	cmake -G Ninja -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug '-DCMAKE_CXX_FLAGS_DEBUG=-g1' -DKVB_SANITIZE=address,undefined -DKVB_BENCH=OFF -DKVB_PYTHON=OFF -DKVB_CUDA=OFF

# Every test but four demo cases: three whose planning the sanitizers
# already see elsewhere, the layout matrix (plan_matrix_test), pipeline
# stages (plan_test's pipeline tests) and context shards (plan_test's
# context tests and the matrix's sharded pairs): the first two took 3 of
# this part's 20 minutes, the context case 90 s, and their ranks run the
# connector's path that the other demo cases run here; and
# the flood, whose figure (throughput under 30,000 idle connections) means
# something only at full speed, while the listener's guarantees under a
# flood run here in listener_test and attack_test. All four run in `check`.
ASAN_EXCLUDE ?= ^demo_(matrix|pipeline|flood|context)$$

# The sanitizers' shadow memory in transparent huge pages: by default they
# ask for small pages there, and on a virtual machine, where a page fault
# costs far more than the page, faulting in the shadow took most of a
# sanitized test's time (a store test ran 60 s under TSan with small pages
# and 18 s with huge ones, 23 s and 14 s under ASan), for a little more
# memory.
SANITIZER_SHADOW := no_huge_pages_for_shadow=0

test-asan: deps $(BUILD_ASAN)/build.ninja
	scripts/timed.sh "test-asan: build" cmake --build $(BUILD_ASAN) -j $(JOBS)
	ASAN_OPTIONS="detect_leaks=1 $(SANITIZER_SHADOW)" UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir $(BUILD_ASAN) --output-on-failure -j $(JOBS) --timeout $(SANITIZED_TEST_TIMEOUT) \
	  -E '$(ASAN_EXCLUDE)'

# The network layer, engine, transport, conformance, connector, store and attack tests under
# ThreadSanitizer. UCX is off here (so KVB_REQUIRE's ucx does not apply): libucm patches
# madvise, which glibc calls at thread exit, and TSan's interceptor crashes inside that hook.
TSAN_TESTS ?= net_test engine_test conformance_test link_conformance_test tcp_test tcp_protocol_test cma_test handshake_test connector_test store_test store_redis_test attack_test discovery_test discovery_sync_test
empty :=
space := $(empty) $(empty)

$(BUILD_TSAN)/build.ninja: CMakeLists.txt | deps
	cmake -G Ninja -S . -B $(BUILD_TSAN) $(OPT_FLAGS) -DKVB_SANITIZE=thread -DKVB_UCX=OFF -DKVB_BENCH=OFF -DKVB_PYTHON=OFF -DKVB_CUDA=OFF

test-tsan: deps $(BUILD_TSAN)/build.ninja
	scripts/timed.sh "test-tsan: build" cmake --build $(BUILD_TSAN) -j $(JOBS) --target $(TSAN_TESTS) kvb_conformance_peer link_peer kvb_attack_peer
	KVB_REQUIRE="$(subst ucx,,$(KVB_REQUIRE))" TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 $(SANITIZER_SHADOW)" ctest --test-dir $(BUILD_TSAN) --output-on-failure -j $(JOBS) --timeout $(SANITIZED_TEST_TIMEOUT) \
	  -R '^($(subst $(space),|,$(strip $(TSAN_TESTS))))$$'

# -O1, as libFuzzer's documentation builds its targets: the fuzz build is
# compiled for every `make test` and runs each target only seconds there.
FUZZ_FLAGS := '-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG'

$(BUILD_FUZZ)/build.ninja: CMakeLists.txt | deps
	CC=clang-14 CXX=clang++-14 cmake -G Ninja -S . -B $(BUILD_FUZZ) $(FUZZ_FLAGS) -DKVB_FUZZ=ON -DKVB_CUDA=OFF -DKVB_TESTS=OFF -DKVB_BENCH=OFF -DKVB_TOOLS=OFF -DKVB_PYTHON=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo

fuzz: deps $(BUILD_FUZZ)/build.ninja
	cmake --build $(BUILD_FUZZ) -j $(JOBS)
	scripts/fuzz.sh $(BUILD_FUZZ) $(FUZZ_SECONDS)

fuzz-short:
	$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=10

bench: build
	scripts/bench.sh $(BUILD)

# The Python package `kvbridge` (extension + pure-Python files) for
# /usr/bin/python3, no network: copied as a plain package directory into
# PYTHON_PREFIX (default: this user's site-packages, so `/usr/bin/python3 -c
# "import kvbridge"` works from anywhere). PYTHON_PREFIX=/some/dir puts it
# there instead (then add /some/dir to PYTHONPATH).
PYTHON_PREFIX ?= $(shell /usr/bin/python3 -c 'import site; print(site.getusersitepackages())')

# The device check's bundle (scripts/gpu-bundle.sh): the C++ parts built
# here for a GPU machine, which runs scripts/gpu-check.sh with it.
gpu-bundle: deps
	scripts/gpu-bundle.sh

install-python: build
	mkdir -p $(PYTHON_PREFIX)
	rm -rf $(PYTHON_PREFIX)/kvbridge
	cp -r $(BUILD)/python/kvbridge $(PYTHON_PREFIX)/kvbridge
	@echo "installed kvbridge into $(PYTHON_PREFIX)/kvbridge"
	cd / && PYTHONPATH=$(PYTHON_PREFIX) /usr/bin/python3 -c 'import kvbridge; print("kvbridge", kvbridge.__version__, "from", kvbridge.__file__)'

clean:
	rm -rf $(BUILD) $(BUILD_ASAN) $(BUILD_FUZZ) $(BUILD_TSAN)
