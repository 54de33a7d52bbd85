# myq — one file, stdlib only. See README.md.
PYTHON ?= python3
VENV   ?= .venv
SPOOL  ?= $(CURDIR)/demo
PREFIX ?= /usr
DESTDIR ?=

.PHONY: demo test test-fast test-sqlite lint bench bench-peers bench-parts bench-wear bench-cpu bench-cpu-startup bench-device bench-idle dist install uninstall embed clean soak soak-bridge

# A real run: a demo spool, three jobs (one fails into the DLQ), one worker.
demo:
	@rm -rf "$(SPOOL)"
	$(PYTHON) myq.py --spool "$(SPOOL)" init
	@mkdir -p "$(SPOOL)-handlers"
	@printf '#!/bin/sh\necho "hello, $$(cat)" >> "$(SPOOL)-handlers/greeted.txt"\n' > "$(SPOOL)-handlers/greet"
	@printf '#!/bin/sh\necho "bad payload: $$(cat)" >&2\nexit 65\n' > "$(SPOOL)-handlers/fragile"
	@chmod +x "$(SPOOL)-handlers/greet" "$(SPOOL)-handlers/fragile"
	$(PYTHON) myq.py --spool "$(SPOOL)" enqueue greet '"world"'
	$(PYTHON) myq.py --spool "$(SPOOL)" enqueue greet '"edge box"'
	$(PYTHON) myq.py --spool "$(SPOOL)" enqueue fragile '{"n": 1}'
	$(PYTHON) myq.py --spool "$(SPOOL)" worker --handlers "$(SPOOL)-handlers" --drain
	$(PYTHON) myq.py --spool "$(SPOOL)" stats
	$(PYTHON) myq.py --spool "$(SPOOL)" list
	@cat "$(SPOOL)-handlers/greeted.txt"

# The test venv.  Its stamp is named after the package list, so a venv made
# for another list installs again.
TEST_PKGS = pytest hypothesis pytest-xdist
STAMP = $(VENV)/.stamp-pytest-hypothesis-xdist
$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check $(TEST_PKGS)
	@touch $@

# The whole suite (CI runs exactly this), spread over TEST_JOBS processes by
# pytest-xdist: twice the cores.  TEST_JOBS=0 runs in this process.
# Measured for issue 24 on a 2-core machine loaded ~12 by other runs (so
# only comparisons hold): a mixed third of the suite (12 files, 430 tests)
# took 301 s with -n 4, 310 s with -n 2, 376 s with -n 6 -- all three held
# up by test_security, then one file (since split in two); 4 and 2 differ
# little there because the other runs kept the cores busy, but many tests
# wait (leases, delays, an outage, timers) rather than compute, and a 3rd
# and 4th process fill those waits on an idle machine; 6 only add
# contention and shrink the timing margins.  Beyond that the suite is
# CPU-bound: ~300 s of CPU run serially (getrusage: self + waited
# children; ~415 s before the tests started myq.py from cached byte code,
# tests/README.md), i.e. ~150 s on 2 cores at best.
# --dist loadfile: the tests of one file run in one process, in file order,
# so a module fixture (the multi-interpreter flows of test_matrix and
# test_light) runs once; worksteal or load would split them and start the
# flows in every process that gets one of their tests; xdist_group marks
# would not do (ignored by pytest-xdist 3.8 under pytest 9.2: pytest-xdist
# issue 1386).
# --no-loadscope-reorder hands out the files in collection order, which
# tests/conftest.py sorts longest first (LONG_FIRST: test_security,
# test_security_swaps, test_policy, test_outage...), so no long file starts
# last and runs alone; the long files are split where one bounded the run.
#
# While working: `make test-fast` (or `pytest -m "not slow" tests`) leaves
# out the tests marked slow (soaks, big scans, every Python of the matrix,
# waits of seconds); CI and `make test` always run them.  One file, serially:
# `.venv/bin/python -m pytest -p no:xdist tests/test_enqueue.py`.
TEST_JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) * 2 )))
PYTEST = $(VENV)/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadfile \
	--no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

# The same suite on the SQLite store (issue 26): every test whose spool
# comes from the `spool` fixture and is not already run on both stores by
# `make test` (nor marked files_only) runs again with the SQLite store
# (tests/conftest.py; ~470 tests).  CI runs it after `make test`.
test-sqlite: $(STAMP)
	MYQ_TEST_STORE=sqlite $(PYTEST) tests

lint:
	$(PYTHON) -m py_compile myq.py
	shellcheck -s sh init.d/myq init.d/myq.procd

# The bench runs on the interpreter itself, not on pyenv's shim: Python
# 3.11 where pyenv has one (the figures of issue 15 are for 3.11), else
# $(PYTHON).  `make bench` = bench/run.py (myq against its own floors),
# bench/mqtt.py (MQTT QoS 1 to a local mosquitto, against a bare socket),
# bench/forward.py (a backlog flushed over a slow link; FORWARD_ARGS=--quick
# for a short run), then
# bench-peers: myq beside huey and persist-queue (bench/peers.py makes the
# bench-only venv bench/.venv-peers; myq itself stays standard library only).
# PEERS_ARGS passes options, e.g. PEERS_ARGS="--cpu-queues all", or
# PEERS_ARGS="--baseline DIR" (another myq.py, e.g. main's, in the same runs).
BENCH_PYTHON ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.11.*/bin/python3) $(PYTHON))
bench:
	$(BENCH_PYTHON) bench/run.py
	$(BENCH_PYTHON) bench/mqtt.py
	$(BENCH_PYTHON) bench/forward.py $(FORWARD_ARGS)
	@$(MAKE) --no-print-directory bench-peers

bench-peers:
	$(BENCH_PYTHON) bench/peers.py $(PEERS_ARGS)

# Where the SQLite store's drained job and enqueue spend their time, a layer
# taken out at each step, against huey and persist-queue (~2 min).
bench-parts:
	$(BENCH_PYTHON) bench/parts.py $(PARTS_ARGS)

# Bytes to disk per job on 1 KiB and 4 KiB ext4 loop devices alone (root, ~2 min),
# then bench/outage.py (issue 37, root, ~40 min): bytes written per hour of
# outage with 2,000 and 20,000 jobs held (both stores), and per drained job
# against the bare rename-read-rename floor, on 4 KiB ext4; medians of 3.
# OUTAGE_ARGS, e.g. "--myq this=myq.py --myq main=../main/myq.py" (both in
# the same runs), "--runs 1 --jobs 2000 --window 10" (a quick look).
bench-wear:
	$(BENCH_PYTHON) bench/peers.py --skip rates,cpu $(PEERS_ARGS)
	$(BENCH_PYTHON) bench/outage.py $(OUTAGE_ARGS)

# Instructions per enqueue and per drained job under callgrind (~30 s).
bench-cpu-startup:
	$(BENCH_PYTHON) bench/cpu.py --startup --python $(BENCH_PYTHON) $(CPU_ARGS)

bench-cpu:
	$(BENCH_PYTHON) bench/cpu.py --python $(BENCH_PYTHON) $(CPU_ARGS)

# Absolute figures for a router engineer (bench/device.py, ~5 min): flash,
# RSS and PSS of supervisor + worker idle and busy, instructions per job,
# `myq enqueue` start-up, on armv7l too under qemu-user where a Debian armhf
# root is; each beside the baseline DEVICE_ARGS="--base REV" (main).
bench-device:
	$(BENCH_PYTHON) bench/device.py $(DEVICE_ARGS)

# The CPU of an idle worker with 8,000 jobs of types it has no handler for
# (issue 36: under 1 % of a core), both stores, medians of 3 (~15 min).
# IDLE_ARGS, e.g. "--runs 1 --after 330" (past the held types' first probes).
bench-idle:
	$(BENCH_PYTHON) bench/idle.py $(IDLE_ARGS)

dist:
	$(PYTHON) build/dist.py

# The program, the init script, /etc/default/myq (kept when present), and the
# manual pages and LICENSE under $(PREFIX)/share.
install:
	$(PYTHON) build/dist.py --install "$(DESTDIR)" --prefix "$(PREFIX)"

# myq.py carries init.d/'s files for `python3 myq.py install` (the one file
# has no init.d/ beside it); after an edit of one of them, refresh it here
# (tests/test_dist.py fails until then).
embed:
	$(PYTHON) build/dist.py --embed

# What install wrote (same DESTDIR and PREFIX); an edited /etc/default/myq stays.
uninstall:
	$(PYTHON) build/dist.py --uninstall "$(DESTDIR)" --prefix "$(PREFIX)"

clean:
	rm -rf $(VENV) dist demo demo-handlers .pytest_cache .hypothesis
	find . -name .git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

# Power cuts (issue 14): QEMU VMs (TCG), two at a time on 2 cores
# (POWERCUT_PARALLEL): ext4 with a dm-log-writes replay, UBIFS on nandsim
# (two VMs share the 200 cuts), a real boot; see tests/powercut/README.md.
# Root only (apt-get, qemu, loop mounts); installs what it needs.
# POWERCUT_MAX_POINTS=0 replays every flush point (default: 300 spread over
# the log, with random subsets each).  POWERCUT_PARTS="ext4 boot": some.
# ext4-sqlite and ubifs-sqlite: the same on a spool of the SQLite store;
# POWERCUT_SQLITE_MAX_POINTS: ext4-sqlite's flush points (>= 200 cuts).
POWERCUT_MAX_POINTS ?= 300
POWERCUT_SQLITE_MAX_POINTS ?= 200
.PHONY: powercut
powercut:
	@if [ "$$(id -u)" != 0 ]; then echo "powercut: skipped: needs root (apt-get, qemu, loop devices, mount)"; exit 0; fi; \
	POWERCUT_MAX_POINTS=$(POWERCUT_MAX_POINTS) POWERCUT_SQLITE_MAX_POINTS=$(POWERCUT_SQLITE_MAX_POINTS) \
	$(PYTHON) tests/powercut/powercut.py $(POWERCUT_PARTS) $(POWERCUT_ARGS)

# The soak (issue 23; tests/soak/README.md): the field trial, time-compressed:
# 20 readings/s from Python, the shell recipe and `myq enqueue`, over HTTP
# (batch=100 batch_wait=5s gzip) and MQTT QoS 1 (batch=50, Mosquitto) to
# receivers in a network namespace behind an emulated cellular link, through
# a link outage, two kill -9 of the worker, 503s, a broker kill, a full disk.
# ~4 minutes; SOAK_MINUTES=N stretches the timeline to ~N minutes.  Root
# only (netns, loop mount); ends with one `soak: accepted=N ... lost=N
# dup=N dup_unexplained=N ... forecast=ok|off|none` line; fails when lost or
# dup_unexplained > 0, or the capacity forecast is beyond +-25 % (forecast=off).
SOAK_MINUTES ?=
SOAK_PYTHON ?= $(BENCH_PYTHON)
soak:
	@if [ "$$(id -u)" != 0 ]; then echo "soak: cannot run here: needs root (network namespaces, a loop mount)"; exit 0; fi; \
	$(SOAK_PYTHON) tests/soak/soak.py $(if $(SOAK_MINUTES),--minutes $(SOAK_MINUTES)) $(SOAK_ARGS)

# The bridge soak (issue 27; tests/soak/README.md): one QoS 1 reading stream
# to two local mosquitto brokers (persistence on): myq intake and a worker
# on one, a Mosquitto bridge (QoS 1, cleansession false) on the other, over
# the soak's link through a 45 s outage, kill -9 of intake and worker and of
# both brokers.  ~2 minutes, root only; ends with one `soak-bridge: side=...
# accepted=N delivered=N lost=N ...` line a side; fails when myq's side lost
# or doubled a reading without a kill or cut to explain it.
soak-bridge:
	@if [ "$$(id -u)" != 0 ]; then echo "soak-bridge: cannot run here: needs root (network namespaces, a loop mount)"; exit 0; fi; \
	$(SOAK_PYTHON) tests/soak/bridge.py $(BRIDGE_ARGS)
