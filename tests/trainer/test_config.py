"""The run config refuses what cannot train (issue 8), naming the field, and its torch-free tensor count is the
real model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from diloco_trainer.config import MODEL_PRESETS, ModelConfig, OuterConfig, TrainConfig, tensor_count
from diloco_trainer.model.gpt import build_model
from diloco_trainer.runtime.session import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cfg", [ModelConfig(seq_len=8, d_model=8, n_layers=1, n_heads=1), *MODEL_PRESETS.values(),
                                 ModelConfig(seq_len=16, d_model=16, n_layers=9, n_heads=2, mlp_ratio=2)])
def test_tensor_count_is_the_number_of_parameter_tensors_of_the_real_model(cfg):
    model = build_model(cfg)
    assert tensor_count(cfg) == len(list(model.parameters())) == len(dict(model.named_parameters()))


def test_fragments_up_to_the_tensor_count_are_accepted_and_one_more_is_refused():
    model = ModelConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2)
    TrainConfig(model=model, outer=OuterConfig(fragments=tensor_count(model)))
    with pytest.raises(ValueError, match=r"outer\.fragments \(13\) must not exceed the model's 12 parameter"):
        TrainConfig(model=model, outer=OuterConfig(fragments=13))


@pytest.mark.parametrize("outer", [{"sync_every": 4, "overlap": 4}, {"sync_every": 4, "overlap": 9},
                                   {"sync_every": 2}])  # the default overlap is 2
def test_an_overlap_not_below_sync_every_is_refused(outer):
    with pytest.raises(ValueError, match=r"outer\.overlap \(\d+\) must be less than outer\.sync_every"):
        TrainConfig.model_validate({"outer": outer})


@pytest.mark.parametrize("section,field", [("model", "d_model"), ("model", "n_layers"), ("model", "seq_len"),
                                           ("inner", "batch_size"), ("outer", "sync_every"),
                                           ("outer", "fragments"), ("outer", "quorum")])
def test_absurd_sizes_are_refused_naming_the_field(section, field):
    with pytest.raises(ValueError, match=rf"{section}\.{field}\n.*less than or equal to"):
        TrainConfig.model_validate({section: {field: 10**12}})


def test_diloco_local_refuses_a_bad_config_file_naming_the_field(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "outer": {"sync_every": 4, "overlap": 6}}))
    with pytest.raises(SystemExit, match=r"outer\.overlap \(6\) must be less than outer\.sync_every \(4\)"):
        load_config(path, [])
    with pytest.raises(SystemExit, match=r"outer\.fragments \(21\) must not exceed"):
        load_config(path, ["outer.overlap=2", "outer.fragments=21"])  # tiny: 2 layers, 20 tensors


def test_every_shipped_config_is_still_valid():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path, [])
