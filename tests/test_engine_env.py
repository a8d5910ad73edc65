"""The variables eagle_compat sets for vLLM (step deadline, MLA off, thread binding) are held per user: vLLM reads
them at every call, so two generators in one process must not unset each other's (A.close() used to unset
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS while B ran: B's queued steps then had vLLM's 300 s deadline)."""
from __future__ import annotations

import os

from eagle_compat import engine

KEY = "EAGLE_COMPAT_TEST_HELD_VARIABLE"


def test_a_variable_stays_until_its_last_holder_releases_it(monkeypatch):
    monkeypatch.delenv(KEY, raising=False)
    a = engine.process_env.apply_env({KEY: "1500"})
    b = engine.process_env.apply_env({KEY: "1500"})
    assert a == b == [KEY] and os.environ[KEY] == "1500"
    engine.process_env.release_env(a)  # generator A closes
    assert os.environ.get(KEY) == "1500"  # B still runs with it
    engine.process_env.release_env(b)
    assert KEY not in os.environ


def test_the_users_own_setting_is_never_changed_or_removed(monkeypatch):
    monkeypatch.setenv(KEY, "42")
    held = engine.process_env.apply_env({KEY: "1500"})
    assert held == [] and os.environ[KEY] == "42"
    engine.process_env.release_env(held)
    assert os.environ[KEY] == "42"


def test_a_value_changed_by_the_user_meanwhile_is_left_alone(monkeypatch):
    monkeypatch.delenv(KEY, raising=False)
    held = engine.process_env.apply_env({KEY: "1500"})
    os.environ[KEY] = "7"  # the user's code changed it while the generator ran
    engine.process_env.release_env(held)
    assert os.environ[KEY] == "7"


def test_the_list_of_what_we_set_keeps_what_this_process_inherited_from_the_run(monkeypatch):
    """A worker of the run (or a spawned child) inherits the driver's variables and their list: it holds none of them
    itself, but its own holds must not drop them from the list (its non-run children would keep them)."""
    from eagle_compat import startup
    inherited = "EAGLE_COMPAT_TEST_INHERITED_VARIABLE"
    monkeypatch.setenv(inherited, "1")
    monkeypatch.setenv(startup.SET_ENV_LIST, inherited)
    monkeypatch.setattr(engine.process_env, "_INHERITED_SET_ENV", frozenset({inherited}))
    monkeypatch.delenv(KEY, raising=False)
    held = engine.process_env.apply_env({KEY: "1500", inherited: "1"})
    assert held == [KEY]  # the inherited one counts as set before us
    assert set(os.environ[startup.SET_ENV_LIST].split(",")) == {KEY, inherited}
    engine.process_env.release_env(held)
    assert os.environ[startup.SET_ENV_LIST] == inherited and os.environ[inherited] == "1"
