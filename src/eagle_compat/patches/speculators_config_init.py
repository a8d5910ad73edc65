"""speculators 0.3.0's trainer cannot build or save a drafter config under transformers 5.

transformers 5 turns every `PretrainedConfig` subclass into a dataclass and gives each one without an `__init__`
of its own a generated one (`configuration_utils.wrap_init_to_accept_kwargs`). speculators' configs are pydantic
models *and* `PretrainedConfig`s whose one `__init__` (on `SpeculatorModelConfig`) initializes pydantic first;
`Eagle3SpeculatorConfig` has none, so transformers' generated one runs instead and the first attribute it sets
fails: `AttributeError: 'Eagle3SpeculatorConfig' object has no attribute '__pydantic_fields_set__'` (the trainer's
`scripts/train.py`, at its first line that builds the drafter). Past that, `save_pretrained` calls
`self.validate()`, which resolves to pydantic's deprecated `BaseModel.validate(value)` classmethod first:
`TypeError` at the end of the first epoch. Data generation never builds these configs; training does.

Applied when `speculators.config` is imported: each speculators config class that transformers gave a generated
`__init__` gets speculators' own back (those defined later, through `__init_subclass__`), and `validate` is
transformers' own. Reverted by uninstall().
"""
from __future__ import annotations

from ._base import PatchUnit

BASE_CLASS = "SpeculatorModelConfig"


def _generated_by_transformers(init, configuration_utils) -> bool:
    code = getattr(init, "__code__", None)
    return code is not None and code.co_filename == configuration_utils.__file__


def _speculators_init(cls, configuration_utils):
    """The nearest `__init__` up the class's bases that transformers did not generate (speculators' own)."""
    for klass in cls.__mro__[1:]:
        init = vars(klass).get("__init__")
        if init is not None and not _generated_by_transformers(init, configuration_utils):
            return init
    raise TypeError(f"{cls.__name__} has no __init__ of speculators' own")


def _apply(patcher, module) -> None:
    from transformers import PretrainedConfig, configuration_utils

    base = getattr(module, BASE_CLASS)

    def repair(cls) -> None:
        init = vars(cls).get("__init__")
        if init is not None and _generated_by_transformers(init, configuration_utils):
            patcher.set(cls, "__init__", _speculators_init(cls, configuration_utils))

    def repair_tree(cls) -> None:
        for sub in cls.__subclasses__():
            repair(sub)
            repair_tree(sub)

    original_hook = vars(base).get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if original_hook is not None:
            original_hook.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        repair(cls)  # after transformers' own hook has generated its __init__

    patcher.set(base, "__init_subclass__", classmethod(__init_subclass__))
    patcher.set(base, "validate", PretrainedConfig.validate)
    repair_tree(base)  # the classes speculators defined before install()


UNIT = PatchUnit(
    name="speculators_config_init",
    needs_vllm=False,
    broke="speculators 0.3.0's trainer fails building its drafter config (pydantic never initialized: transformers "
          "replaced its __init__) and saving it (validate() is pydantic's)",
    affects="",
    condition="transformers >= 5 (it generates config __init__s; vLLM >= 0.24 requires it, 0.20-0.23 allow it)",
    delete_when="the speculators floor builds and saves its configs under transformers 5",
    target="speculators.config",
    sides=("driver",),
    feature="transformers_generates_config_init",
    apply=_apply,
)
