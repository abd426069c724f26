# Two commands for a newcomer (run from the repository root: the model in models/ runs from the
# checkout, the editable install provides jaxflash):
#   make demo   - set up .venv and run the Qwen2.5 generate demo (random-weight default model,
#                 or CHECKPOINT=/path/to/hf/dir PROMPT='...': the prompt reaches the program
#                 through the environment, never through a shell; PROMPT= (empty) is an error)
#   make test   - set up .venv and run the test suite (CPU: kernels interpreted; GPU: also compiled)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRA  ?=
ARGS   ?=
# PROMPT given (even empty): exported as it was typed ($(value) keeps make from expanding it)
# and read by the program from the environment, so no shell interprets quotes, $ or backticks.
PROMPT_GIVEN := $(filter-out undefined,$(origin PROMPT))
ifneq ($(PROMPT_GIVEN),)
override PROMPT := $(value PROMPT)
export PROMPT
endif

.PHONY: demo test setup setup-test bench clean

$(VENV)/.setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[model,train$(EXTRA)]"
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup
	$(PY) -m pip install -q -e ".[test$(EXTRA)]"
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

demo: setup
	$(PY) -m models.generate $(if $(CHECKPOINT),--checkpoint "$(CHECKPOINT)") $(if $(PROMPT_GIVEN),--prompt-env PROMPT) $(ARGS)

test: setup-test
	$(PY) -m pytest -q -n 2 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
