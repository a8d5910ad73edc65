"""Each Ray node's releases are recorded, and a node whose releases would compute other states is refused.

Before, the manifest recorded the driver's versions only: an actor on a node with another vLLM, torch, transformers
or eagle_compat added states of another computation to the set, unsaid. Against the scripted stand-in for Ray of
test_ray_scheduling.py (no cluster, no engine)."""
from __future__ import annotations

import pytest

from eagle_compat.extract import ray_runner

import test_ray_scheduling as scripted


def _with_versions(monkeypatch, versions_of_rank):
    original = scripted.FakeActor._run_batch

    def run_batch(self, batch, expected_dtype=None):
        reply = original(self, batch, expected_dtype)

        def with_versions():
            out = reply()
            return {**out, "versions": versions_of_rank(self.rank)}
        with_versions.outcome, with_versions.hung = reply.outcome, reply.hung
        return with_versions
    monkeypatch.setattr(scripted.FakeActor, "_run_batch", run_batch)


def test_every_nodes_releases_are_recorded(monkeypatch, tmp_path):
    same = ray_runner.states_versions()
    _with_versions(monkeypatch, lambda rank: dict(same))
    _, per_actor, done = scripted._run(monkeypatch, tmp_path, {0: [], 1: []})
    assert done == 40
    assert all(a["versions"] == same for a in per_actor)


def test_a_node_with_another_vllm_is_refused_naming_it(monkeypatch, tmp_path):
    same = ray_runner.states_versions()
    _with_versions(monkeypatch, lambda rank: {**same, "vllm": "0.0.1"} if rank == 1 else dict(same))
    with pytest.raises(ray_runner.RayExtractError, match=r"actor 1 on h runs vllm 0.0.1 \(the driver: .*\)"):
        scripted._run(monkeypatch, tmp_path, {0: [], 1: []})
