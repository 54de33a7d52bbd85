# myq — one file, stdlib only. See README.md.
PYTHON ?= python3
VENV   ?= .venv
SPOOL  ?= $(CURDIR)/demo
PREFIX ?= /usr
DESTDIR ?=

.PHONY: demo test lint bench dist install uninstall clean

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

$(VENV)/.stamp:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check pytest hypothesis
	@touch $@

test: $(VENV)/.stamp
	$(VENV)/bin/python -m pytest -q tests

lint:
	$(PYTHON) -m py_compile myq.py
	shellcheck -s sh init.d/myq init.d/myq.procd

bench:
	$(PYTHON) bench/run.py

dist:
	$(PYTHON) build/dist.py

# The program, the init script, /etc/default/myq (kept when present), and the
# manual pages and LICENSE under $(PREFIX)/share.
install:
	$(PYTHON) build/dist.py --install "$(DESTDIR)" --prefix "$(PREFIX)"

# What install wrote (same DESTDIR and PREFIX); an edited /etc/default/myq stays.
uninstall:
	$(PYTHON) build/dist.py --uninstall "$(DESTDIR)" --prefix "$(PREFIX)"

clean:
	rm -rf $(VENV) dist demo demo-handlers .pytest_cache .hypothesis
	find . -name .git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
