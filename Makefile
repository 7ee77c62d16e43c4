# ddp-lab: everyday commands. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
TORCH_PIP_ARGS ?=
INVENTORY ?= inventory/lab
# The molecule scenarios `make test` (and so CI) runs, side by side: `default` (snapshot, provision,
# idempotence, reset.yml, compare with the snapshot, provision again, the verifier's checks) and
# `fault`, which runs site.yml with the short run of `train` and checks it with train's tests, then
# the fault runs (poweroff of rank 0, rejoin, freeze) on the same nodes, provisioned once.
# `train` alone: `make molecule SCENARIOS=train`.
SCENARIOS ?= default fault
ALL_SCENARIOS := $(patsubst molecule/%/molecule.yml,%,$(wildcard molecule/*/molecule.yml))
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Podman settings this host needs (runtime, rlimits), found by lab/lab.py; see docs/lab.md.
LAB_CONTAINERS_CONF := $(CURDIR)/lab/.state/containers.conf
ifneq ($(wildcard $(LAB_CONTAINERS_CONF)),)
export CONTAINERS_CONF := $(LAB_CONTAINERS_CONF)
endif
LAB := $(PYTHON) lab/lab.py

.PHONY: help deps deps-test venv image lab-up lab-down lab-status demo test test-unit lint molecule test-nodes5 doctor status logs stop reset report bench clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

deps: ## install the host packages the lab needs (podman, runc, debootstrap, ...) when missing
	lab/host-deps.sh

deps-test: ## deps, plus what the tests run on the controller (network-manager's --print-config)
	lab/host-deps.sh --test

$(VENV)/.done: requirements.txt requirements-torch.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q $(TORCH_PIP_ARGS) -r requirements-torch.txt
	touch $@

# The plugins (collection ddp_lab.cluster) import the node runtime's rules as `ddplab.*`, molecule's
# inventory plugin the lab's node names as `lab`: this checkout's train/ and lab/ on the venv's path
# (a .pth file; each checkout has its own venv; rewritten when this Makefile changes).
$(VENV)/.ddplab-path: $(VENV)/.done Makefile
	$(VENV)/bin/python -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_path("purelib"), "ddp-lab-train.pth").write_text("$(CURDIR)/train\n$(CURDIR)/lab\n")'
	touch $@

venv: $(VENV)/.done $(VENV)/.ddplab-path ## the controller venv: ansible, molecule, linters, torch (pinned); train/ on its path

# lab/lab.py writes containers.conf with tomli_w (requirements.txt): it runs with the venv's python.
image: deps venv ## build the lab node image offline (debootstrap -> podman import -> build); cached
	$(LAB) image

# LAB_NODES: how many laptops (laptop-a, laptop-b, ...); empty = the running lab's size, else 3.
LAB_NODES ?=
# LAB_CPUS: a CPU quota per laptop in CPUs (0.6,0.6,0.3; one value for all; off); LAB_LINK_MBIT: every
# laptop's link shaped to this rate (1000; off). Empty = keep what the lab has (docs/lab.md).
LAB_CPUS ?=
LAB_LINK_MBIT ?=

lab-up: deps venv ## LAB_NODES (default 3) systemd containers laptop-a, -b, ... on the network ddp-lab, SSH as labadmin; writes inventory/lab/hosts.yml; LAB_CPUS=0.6,0.6,0.3 LAB_LINK_MBIT=1000 limit them
	$(LAB) up $(if $(LAB_NODES),--nodes $(LAB_NODES)) $(if $(LAB_CPUS),--cpus $(LAB_CPUS)) $(if $(LAB_LINK_MBIT),--link-mbit $(LAB_LINK_MBIT))

lab-down: ## remove the lab containers, network, inventory and SSH state (lab/.state/ssh)
	$(LAB) down

lab-status: ## image, network and node states of the lab
	$(LAB) status

# A local copy of the dataset (checksum-verified like a download): used instead of the internet
# when it exists, e.g. on machines without access to GitHub. `make demo DATASET=` downloads.
DATASET ?= $(wildcard $(abspath $(CURDIR)/../shared/data/tinyshakespeare/input.txt))
DEMO_ARGS ?=

demo: lab-up ## the main job: bring up the lab, run site.yml end to end, print the run's folder
	ansible-playbook -i $(INVENTORY) site.yml $(if $(DATASET),-e ddp_job_dataset_src=$(DATASET)) $(DEMO_ARGS)
	@echo "run folder: $$(readlink -f runs/current)"

# The unit tests and the linters run beside the molecule scenarios, three lanes at once (the
# scenarios spend much of their time waiting on podman, SSH and training): the output of each of the
# first two goes to build/test-unit.log and build/lint.log and is printed once all are done, then
# one line with each lane's exit status and wall time (the scenarios' own lines come before it).
# TEST_PARALLEL=0 runs them one after the other.
TEST_PARALLEL ?= 1

test: deps-test venv image ## everything CI runs: unit tests, linters, molecule scenarios
ifeq ($(TEST_PARALLEL),0)
	$(MAKE) test-unit lint molecule MOLECULE_PARALLEL=0
else
	@mkdir -p build; start=$$(date +%s); \
	for lane in test-unit lint; do \
	  ( t=$$(date +%s); $(MAKE) --no-print-directory $$lane > build/$$lane.log 2>&1; \
	    echo "$$? $$(( $$(date +%s) - t ))" > build/$$lane.rc ) & \
	done; \
	$(MAKE) --no-print-directory molecule; mol=$$?; mol_s=$$(( $$(date +%s) - start )); \
	wait; read unit unit_s < build/test-unit.rc; read lint lint_s < build/lint.rc; \
	echo "== unit tests (build/test-unit.log) =="; cat build/test-unit.log; \
	echo "== linters (build/lint.log) =="; cat build/lint.log; \
	echo "make test: unit tests exit $$unit in $$unit_s s, linters exit $$lint in $$lint_s s," \
	  "molecule exit $$mol in $$mol_s s; $$(( $$(date +%s) - start )) s in all"; \
	[ "$$unit" -eq 0 ] && [ "$$lint" -eq 0 ] && [ "$$mol" -eq 0 ]
endif

# pytest exits 5 when it collects no test: not a failure of the suite. PYTEST_WORKERS pytest-xdist
# workers (most slow tests wait on torchrun, ansible-playbook or podman; 0: one process), work
# stealing so that a worker left with slow tests gives some away; the 20 slowest are listed.
PYTEST_WORKERS ?= 4
PYTEST_ARGS ?=
test-unit: venv ## Python unit tests and the bad-input matrix
	pytest -q $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist worksteal) --durations=20 $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

# ruff: every Python file of the project (roles' plugins and modules, benchmarks, molecule verifiers).
lint: venv ## ansible-lint (production profile), yamllint, ruff
	yamllint -s .
	ansible-lint
	ruff check .

# Lanes of scenarios run side by side, the scenarios of one lane (joined by +) one after the other;
# MOLECULE_LANES defaults to one lane per scenario of SCENARIOS. MOLECULE_PARALLEL=0: all one after
# the other, in this shell. Each scenario's containers, network and SSH state are named after it
# (DDP_LAB_MOLECULE_NAME=<MOLECULE_PREFIX>-<scenario>), its subnet is its own
# (DDP_LAB_MOLECULE_NET=10.89.<MOLECULE_NET_FIRST + its place in the lanes>) and so are its ports (its
# extra_vars.yml; tests/test_molecule_isolation.py checks them). Each scenario writes
# build/molecule-<scenario>.log, printed when all are done, ending in its exit status and wall time.
MOLECULE_PARALLEL ?= 1
MOLECULE_LANES ?= $(SCENARIOS)
MOLECULE_PREFIX ?= $(or $(DDP_LAB_MOLECULE_NAME),mol)
MOLECULE_NET_FIRST ?= 211
LANE_SCENARIOS = $(subst +, ,$(MOLECULE_LANES))

molecule: venv image ## run the multi-node molecule scenarios (SCENARIOS=..., default: default fault)
ifeq ($(MOLECULE_PARALLEL),0)
	set -e; for s in $(LANE_SCENARIOS); do \
	  start=$$(date +%s); molecule test -s $$s; echo "molecule $$s: $$(( $$(date +%s) - start )) s"; \
	done
else
	@mkdir -p build; i=0; pids=""; for s in $(LANE_SCENARIOS); do rm -f build/molecule-$$s.log; done; \
	for lane in $(MOLECULE_LANES); do \
	  first=$$i; i=$$(( i + $$(echo "$$lane" | tr '+' ' ' | wc -w) )); \
	  ( n=$$first; for s in $$(echo "$$lane" | tr '+' ' '); do \
	      start=$$(date +%s); \
	      DDP_LAB_MOLECULE_NAME=$(MOLECULE_PREFIX)-$$s DDP_LAB_MOLECULE_NET=10.89.$$(( $(MOLECULE_NET_FIRST) + n )) \
	        molecule test -s $$s > build/molecule-$$s.log 2>&1; rc=$$?; n=$$(( n + 1 )); \
	      echo "molecule $$s: exit $$rc, $$(( $$(date +%s) - start )) s" | tee -a build/molecule-$$s.log; \
	      [ $$rc -eq 0 ] || exit $$rc; \
	    done ) & pids="$$pids $$!"; \
	done; \
	rc=0; for p in $$pids; do wait $$p || rc=1; done; \
	for s in $(LANE_SCENARIOS); do [ -f build/molecule-$$s.log ] || continue; \
	  echo "== molecule $$s (build/molecule-$$s.log) =="; cat build/molecule-$$s.log; done; \
	for s in $(LANE_SCENARIOS); do [ -f build/molecule-$$s.log ] && tail -n 1 build/molecule-$$s.log; done; \
	exit $$rc
endif

# Five lab laptops (N > 3) on this machine: elastic 1:5, poweroff of rank 0's node, rejoin, summary
# and report for 5 hosts (molecule/nodes5). Not in SCENARIOS: five laptops on two cores take longer
# than make test's whole budget.
test-nodes5: venv image ## molecule scenario nodes5: five laptops, elastic 1:5, poweroff + rejoin (not in make test)
	$(MAKE) --no-print-directory molecule SCENARIOS=nodes5

doctor: venv ## preflight checks alone, a table per node
	ansible-playbook -i $(INVENTORY) doctor.yml

status: venv ## one table: the job on every laptop and the rendezvous store (read-only)
	ansible-playbook -i $(INVENTORY) status.yml

logs: venv ## a laptop's agent journal and worker stderr: make logs NODE=laptop-b [RANK=1] [LINES=50]
	@test -n "$(NODE)" || { echo "make logs: name the laptop: make logs NODE=<inventory host> (the hosts: make status)" >&2; exit 2; }
	ansible-playbook -i $(INVENTORY) logs.yml -e node=$(NODE) $(if $(RANK),-e rank=$(RANK)) $(if $(LINES),-e lines=$(LINES))

stop: venv ## end a running job everywhere
	ansible-playbook -i $(INVENTORY) stop.yml

reset: venv ## give the laptops back as before provisioning: make reset CONFIRM=yes (without: --check, lists only)
	ansible-playbook -i $(INVENTORY) reset.yml $(if $(filter yes,$(CONFIRM)),-e reset_confirm=yes,--check)

report: venv ## (re)build the report of runs/current (RUN=runs/<run_id> for another)
	PYTHONPATH=train python -m ddplab.controller.report $(or $(RUN),runs/current)

bench: venv ## all-reduce, link and scaling benchmarks on the cluster
	ansible-playbook -i $(INVENTORY) bench.yml

clean: ## remove build artefacts (keeps runs/)
	rm -rf build .pytest_cache .ruff_cache
