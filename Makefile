# myq — one file, stdlib only. See README.md.
PYTHON ?= python3
VENV   ?= .venv
SPOOL  ?= $(CURDIR)/demo
PREFIX ?= /usr
DESTDIR ?=

.PHONY: demo test test-fast test-sqlite lint bench bench-peers bench-parts bench-wear bench-cpu bench-cpu-startup bench-flow bench-device bench-idle dist docs install uninstall embed clean soak soak-bridge soak-3h

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

# The test venv (its stamp names the package list: another list installs again).
TEST_PKGS = pytest hypothesis pytest-xdist
STAMP = $(VENV)/.stamp-pytest-hypothesis-xdist
$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check $(TEST_PKGS)
	@touch $@

# The whole suite (CI runs exactly this) over TEST_JOBS processes, three
# a core (TEST_JOBS=0: in this process), a file to a process, the
# longest first (tests/README.md: why these options).  `make test-fast`
# leaves out the tests marked slow.
# pytest itself writes byte code (its processes load the tests'
# assert-rewritten modules from __pycache__: ~4 s of CPU each); what the
# tests start gets the caller's PYTHONDONTWRITEBYTECODE (tests/conftest.py).
# The tests' files (tmp_path: spools, handlers, logs) go on a tmpfs where
# /dev/shm is one we can write and run a script from (TEST_TMPDIR=DIR:
# another; TEST_TMPDIR=: the default /tmp): on a disk, the suite's fsyncs
# took it from ~3:25 to ~5:30 on a loaded machine (tests/README.md).
ifeq ($(origin TEST_TMPDIR),undefined)
TEST_TMPDIR := $(shell f=$$(mktemp /dev/shm/myq-tmpdir-XXXXXX 2>/dev/null) && \
	printf '\043!/bin/sh\n' > "$$f" && chmod 700 "$$f" && "$$f" && \
	echo /dev/shm; rm -f "$$f")
endif
TEST_JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) * 3 )))
PYTEST = env -u PYTHONDONTWRITEBYTECODE \
	TESTS_DONTWRITEBYTECODE="$$PYTHONDONTWRITEBYTECODE" \
	$(if $(TEST_TMPDIR),TMPDIR="$(TEST_TMPDIR)") \
	$(VENV)/bin/python -m pytest -q -n $(TEST_JOBS) --dist loadfile \
	--no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

# The suite's tests of a spool again, on the SQLite store (those `make
# test` ran on files alone; tests/README.md).  CI runs it after `make test`.
test-sqlite: $(STAMP)
	MYQ_TEST_STORE=sqlite $(PYTEST) tests

lint:
	$(PYTHON) -m py_compile myq.py
	shellcheck -s sh init.d/myq init.d/myq.procd

# The benches (bench/README.md: what each measures, its options, its
# figures) run on pyenv's 3.11 itself where there is one, else $(PYTHON).
BENCH_PYTHON ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.11.*/bin/python3) $(PYTHON))
bench:
	$(BENCH_PYTHON) bench/run.py
	$(BENCH_PYTHON) bench/mqtt.py
	$(BENCH_PYTHON) bench/forward.py $(FORWARD_ARGS)
	@$(MAKE) --no-print-directory bench-peers

bench-peers:
	$(BENCH_PYTHON) bench/peers.py $(PEERS_ARGS)

bench-parts:
	$(BENCH_PYTHON) bench/parts.py $(PARTS_ARGS)

# bytes to disk per job, RAM first against durable (bench/wear.py, ~8 min;
# WEAR_ARGS=--ubifs: also UBIFS in a QEMU guest), per job and per hour of
# outage (root, ~40 min)
bench-wear:
	$(BENCH_PYTHON) bench/wear.py $(WEAR_ARGS)
	$(BENCH_PYTHON) bench/peers.py --skip rates,cpu $(PEERS_ARGS)
	$(BENCH_PYTHON) bench/outage.py $(OUTAGE_ARGS)

# the slow flow: the worker's CPU and syscalls a reading, idle CPU, its
# start at depth; FLOW_OLD beside this tree (bench/README.md)
FLOW_OLD ?= e996a1f
bench-flow:
	$(PYTHON) bench/flow.py --old $(FLOW_OLD) $(FLOW_ARGS)

# instructions per enqueue and per drained job under callgrind (~30 s)
bench-cpu-startup:
	$(BENCH_PYTHON) bench/cpu.py --startup --python $(BENCH_PYTHON) $(CPU_ARGS)

bench-cpu:
	$(BENCH_PYTHON) bench/cpu.py --python $(BENCH_PYTHON) $(CPU_ARGS)

# flash, memory, instructions and start-up on the device (~5 min); then
# the README's device table rewritten (DEVICE_ARGS=--no-readme: not)
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

# After an edit of init.d/'s files: refresh the copies myq.py carries for
# `myq install` (tests/test_dist.py fails until then).
embed:
	$(PYTHON) build/dist.py --embed

# myq.py's table of the init settings (_INIT_SETTINGS) written out: the
# settings files init.d/myq.default and init.d/myq.config, and the list in
# myq(1)'s INIT SCRIPTS (tests/test_docs.py fails until then).
docs:
	$(PYTHON) build/dist.py --docs

# What install wrote (same DESTDIR and PREFIX); an edited /etc/default/myq stays.
uninstall:
	$(PYTHON) build/dist.py --uninstall "$(DESTDIR)" --prefix "$(PREFIX)"

clean:
	rm -rf $(VENV) dist demo demo-handlers .pytest_cache .hypothesis
	find . -name .git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

# Power cuts in QEMU VMs, root only (tests/powercut/README.md: the parts,
# POWERCUT_PARTS, POWERCUT_PARALLEL, the flush points and cuts).
POWERCUT_MAX_POINTS ?= 300
POWERCUT_SQLITE_MAX_POINTS ?= 200
.PHONY: powercut
powercut:
	@if [ "$$(id -u)" != 0 ]; then echo "powercut: skipped: needs root (apt-get, qemu, loop devices, mount)"; exit 0; fi; \
	POWERCUT_MAX_POINTS=$(POWERCUT_MAX_POINTS) POWERCUT_SQLITE_MAX_POINTS=$(POWERCUT_SQLITE_MAX_POINTS) \
	$(PYTHON) tests/powercut/powercut.py $(POWERCUT_PARTS) $(POWERCUT_ARGS)

# The soak and the bridge soak, root only (tests/soak/README.md: the
# timelines, the summary lines, what fails them; SOAK_MINUTES stretches).
SOAK_MINUTES ?=
SOAK_PYTHON ?= $(BENCH_PYTHON)
soak:
	@if [ "$$(id -u)" != 0 ]; then echo "soak: cannot run here: needs root (network namespaces, a loop mount)"; exit 0; fi; \
	$(SOAK_PYTHON) tests/soak/soak.py $(if $(SOAK_MINUTES),--minutes $(SOAK_MINUTES)) $(SOAK_ARGS)

soak-bridge:
	@if [ "$$(id -u)" != 0 ]; then echo "soak-bridge: cannot run here: needs root (network namespaces, a loop mount)"; exit 0; fi; \
	$(SOAK_PYTHON) tests/soak/bridge.py $(BRIDGE_ARGS)

# After a 3-hour outage, time-compressed (~2.5 minutes, no root; tests/soak/README.md
# "The 3-hour outage"): live lag and the backlog's drain under the cap.
soak-3h:
	$(SOAK_PYTHON) tests/soak/outage3h.py $(SOAK_3H_ARGS)
