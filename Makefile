# ddp-lab: everyday commands. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
TORCH_PIP_ARGS ?=
INVENTORY ?= inventory/lab
SCENARIOS ?= default train fault
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: help deps venv image lab-up lab-down demo test test-unit lint molecule doctor stop report bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

deps: ## install the host packages the lab needs (podman, runc, debootstrap, ...) when missing
	lab/host-deps.sh

$(VENV)/.done: requirements.txt requirements-torch.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q $(TORCH_PIP_ARGS) -r requirements-torch.txt
	touch $@

venv: $(VENV)/.done ## the controller venv: ansible, molecule, linters, torch (pinned)

image: deps ## build the lab node image offline (debootstrap -> podman import -> build)
	lab/lab.sh image

lab-up: deps venv ## three systemd containers laptop-a/b/c on the network ddp-lab; writes inventory/lab/hosts.yml
	lab/lab.sh up

lab-down: ## remove the lab containers and network
	lab/lab.sh down

demo: lab-up ## the main job: bring up the lab and run site.yml end to end
	ansible-playbook -i $(INVENTORY) site.yml

test: deps venv image ## everything CI runs: unit tests, linters, molecule scenarios
	$(MAKE) test-unit lint molecule

test-unit: venv ## Python unit tests and the bad-input matrix
	pytest -q

lint: venv ## ansible-lint (production profile), yamllint, ruff
	yamllint -s .
	ansible-lint
	ruff check train tests lab

molecule: venv image ## run the multi-node molecule scenarios ($(SCENARIOS))
	set -e; for s in $(SCENARIOS); do molecule test -s $$s; done

doctor: venv ## preflight checks alone, a table per node
	ansible-playbook -i $(INVENTORY) doctor.yml

stop: venv ## end a running job everywhere
	ansible-playbook -i $(INVENTORY) stop.yml

bench: venv ## all-reduce, link and scaling benchmarks on the cluster
	ansible-playbook -i $(INVENTORY) bench.yml

clean: ## remove build artefacts (keeps runs/)
	rm -rf build .pytest_cache .ruff_cache
