"""Every public entry refuses a wrong call with an error whose message names the fix.

The calls a new user gets wrong first: ``register`` on a bare module, a dict for a Config,
``GradSync`` on a DDP-wrapped or frozen model or before ``init_process_group``, ``compress``
on a model that was never ``fully_shard``-ed, a checkpoint of an object with no state.
(Accelerate's and Lightning's own refusals are in their test files; the Trainer callback's
in tests/test_transformers.py.)
"""

from __future__ import annotations

import pytest
from torch import nn

import gradsync
import gradsync.checkpoint
import gradsync.ddp
import gradsync.fsdp
from gradsync.testing import run_distributed


def test_ddp_register_on_a_bare_module_names_the_wrapper():
    # before: AttributeError: 'Linear' object has no attribute 'module'
    with pytest.raises(TypeError, match=r"got Linear: wrap it first.*DistributedDataParallel\("
                                        r"model\).*gradsync.GradSync"):
        gradsync.ddp.register(nn.Linear(2, 2), gradsync.Config())


def _register_with_a_dict(rank: int, world_size: int) -> str:
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    try:
        gradsync.ddp.register(ddp, {"scheme": "per_tensor", "density": 0.1})
    except TypeError as e:
        return str(e)
    return "no error"


def test_ddp_register_with_a_dict_names_config():
    (msg,) = run_distributed(_register_with_a_dict, 1)
    assert "gradsync.ddp.register takes a gradsync.Config" in msg
    assert "gradsync.Config.from_dict" in msg


def test_ddp_hook_refuses_a_non_module():
    with pytest.raises(TypeError, match=r"model must be the nn\.Module DDP wraps"):
        gradsync.ddp.hook(gradsync.Config(), model="net")


def test_gradsync_refuses_a_wrong_model_or_config():
    with pytest.raises(TypeError, match="takes the model"):
        gradsync.GradSync([nn.Linear(2, 2)], gradsync.Config())
    with pytest.raises(TypeError, match=r"GradSync takes a gradsync.Config.*from_dict"):
        gradsync.GradSync(nn.Linear(2, 2), {"scheme": "topka"})
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"no parameter that requires grad.*requires_grad=True"):
        gradsync.GradSync(frozen, gradsync.Config())


def _gradsync_on_ddp(rank: int, world_size: int) -> str:
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    try:
        gradsync.GradSync(ddp, gradsync.Config())
    except TypeError as e:
        return str(e)
    return "no error"


def test_gradsync_refuses_a_ddp_wrapped_model():
    (msg,) = run_distributed(_gradsync_on_ddp, 1)
    assert "pass the bare model" in msg and "gradsync.ddp.register(ddp_model, cfg)" in msg


def test_gradsync_before_init_process_group_under_a_launcher(monkeypatch):
    # torchrun sets WORLD_SIZE; without init_process_group each rank would train alone
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"2 processes.*init_process_group\(\) before"):
        gradsync.GradSync(nn.Linear(2, 2), gradsync.Config())
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: a plain local run, as documented
    sync = gradsync.GradSync(nn.Linear(2, 2), gradsync.Config())
    assert sync.P == 1


def test_fsdp_compress_without_fully_shard_names_it():
    with pytest.raises(ValueError, match=r"no fully_shard-ed.*call torch.distributed.fsdp."
                                         r"fully_shard"):
        gradsync.fsdp.compress(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"takes a gradsync.fsdp.TAGCConfig"):
        gradsync.fsdp.compress(nn.Linear(2, 2), {"ratio": 10})
    with pytest.raises(TypeError, match=r"takes the fully_shard-ed nn\.Module"):
        gradsync.fsdp.compress("model")


def test_checkpoint_of_an_object_without_state_names_what_to_pass(tmp_path):
    for call in (gradsync.checkpoint.save, gradsync.checkpoint.load):
        with pytest.raises(TypeError, match=r"sync= must be .*gradsync.GradSync.*HookState"):
            call(str(tmp_path), sync=nn.Linear(2, 2))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="density"):
        gradsync.Config(density=0.0)
    with pytest.raises(ValueError, match="scheme"):
        gradsync.Config(scheme="nope")
    with pytest.raises(ValueError, match="unknown Config keys"):
        gradsync.Config.from_dict({"densty": 0.1})
