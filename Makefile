# The two commands of the README.  Each creates the virtual environment on first use.
#   make run    set up, then run the main job (klpo train) on the built-in defaults
#   make test   set up, then lint, format-check and run the whole test suite
#   make run-real  the real-model job: SmolLM2-135M-Instruct, GRPO with LoRA on the built-in chat
#               task, held-out accuracy before and after (about 30 minutes on 2 cores;
#               docs/real-models.md); `make real-models` first makes the model
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.klpo-installed

# Where `make real-models` puts the converted real models (the test suite reads the same variable).
KLPO_REAL_MODELS ?= $(HOME)/.cache/klpo/real-models

.PHONY: run run-real test lint format clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/klpo train --set run.out_dir=runs/train-$$(date +%Y%m%d-%H%M%S)

run-real: $(STAMP) real-models
	OMP_WAIT_POLICY=PASSIVE $(BIN)/klpo train -c configs/smollm2-chat-grpo-lora.yaml \
	  --set model.policy=$(KLPO_REAL_MODELS)/SmolLM2-135M-Instruct --set run.threads=2 \
	  --set run.out_dir=runs/real-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
	  OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
