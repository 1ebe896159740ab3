# Two commands on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

DEMO_STEPS ?= 200
DEMO_DIR ?= runs/demo

.PHONY: setup test test-fast demo dataset bench horovod clean

# The venv is (re)built when setup.py changes; otherwise this is a no-op.
$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit and socket tests only (no MXNet processes): a few seconds.
test-fast: setup
	$(PY) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

# Fashion-MNIST comes from the Debian package (installed when missing and we are root).
dataset:
	@if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; \
	else echo "Fashion-MNIST is missing: run 'sudo apt-get install dataset-fashion-mnist'"; exit 1; fi

# The main job: AlexNet on Fashion-MNIST, 2 workers + 1 server, kvstore='dgt'.
demo: setup dataset
	mkdir -p $(DEMO_DIR)
	$(PY) examples/launch.py -n 2 -- $(PY) examples/train_alexnet.py --kvstore dgt \
	  --dataset fashion-mnist --max-steps $(DEMO_STEPS) --eval-samples 2000 --eval-every 50 \
	  --log $(DEMO_DIR)/curve-{model}-{kvstore}.jsonl
	$(PY) -m dgt.plot $(DEMO_DIR)/curve-alexnet-dgt.jsonl -o $(DEMO_DIR)/plots
	@echo "plots are in $(DEMO_DIR)/plots"

# Horovod, a peer for benchmarks/compare.py (not a dependency of dgt): built here against the
# venv's MXNet, CPU only, with Gloo. It needs cmake and g++, and a few minutes on 2 cores.
horovod: setup
	$(PY) -m pip install -q wheel psutil pyyaml cloudpickle packaging
	HOROVOD_WITH_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
	  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 \
	  $(PY) -m pip install -q --no-build-isolation horovod==0.28.1
	$(PY) -c "import horovod.mxnet; print('horovod', horovod.__version__, 'ready')"

bench: setup
	$(PY) benchmarks/loopback.py

clean:
	rm -rf $(VENV) *.egg-info
