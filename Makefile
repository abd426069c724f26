# Two commands for a newcomer (run from the repository root: the model in models/ runs from the
# checkout, the editable install provides jaxflash):
#   make demo   - set up .venv and run the Qwen2.5 generate demo (random-weight default model,
#                 or CHECKPOINT=/path/to/hf/dir PROMPT="...")
#   make test   - set up .venv and run the test suite (CPU: kernels interpreted; GPU: also compiled)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRA  ?=
ARGS   ?=

.PHONY: demo test setup setup-test bench clean

$(VENV)/.setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[bench$(EXTRA)]"
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup
	$(PY) -m pip install -q -e ".[test,bench$(EXTRA)]"
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

demo: setup
	$(PY) -m models.generate $(if $(CHECKPOINT),--checkpoint "$(CHECKPOINT)") $(if $(PROMPT),--prompt "$(PROMPT)") $(ARGS)

test: setup-test
	$(PY) -m pytest -q -n 2 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
