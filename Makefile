# The README's two commands: `make demo` and `make test`. Each creates .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

CHROMIUM := /usr/bin/chromium

.PHONY: demo test lint bench clean browser

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned to exactly 2.13.0 (this machine kind has its CPU wheel on disk); an
	# unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pagedkv demo

test: $(STAMP) browser
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(PY) -m pytest -q

# The page-map test drives Debian's chromium through playwright (playwright's own browser
# download is not reachable here). Install it when missing and the machine allows it (root and
# apt-get); otherwise that test fails and says what to install.
browser:
	@if [ ! -x $(CHROMIUM) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium for the page-map browser test"; \
	    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
	      || echo "could not install chromium: the page-map browser test will fail"; \
	  else \
	    echo "$(CHROMIUM) is missing (install Debian's chromium as root): the page-map browser test will fail"; \
	  fi; \
	fi

bench: $(STAMP)
	$(PY) bench/memory_bench.py

clean:
	rm -rf $(VENV)
