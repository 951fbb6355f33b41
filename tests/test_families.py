"""The model-family registry (training/families/): lookup, registration by keyword, a new family
by one register call that the config, the model factory and the trainer's hooks then see."""

import dataclasses

import pytest

from megatron_video.models.video_dit import VideoDiT
from megatron_video.training import family_spec
from megatron_video.training.config import load_config, validate
from megatron_video.training.families import (
    DiffusionFamily,
    FamilySpec,
    VideoLLaVAFamily,
    WanFamily,
    family_names,
    get_family,
    register_family,
)
from megatron_video.training.model_factory import transformer_config

BUILT_IN = ("video_dit", "stdit", "ar_dit", "qwen_vl", "video_llava", "wan", "wan_ar")


def test_built_in_families_are_registered():
    assert family_names() == BUILT_IN
    for name in BUILT_IN:
        spec = get_family(name)
        assert spec.name == name and isinstance(spec, FamilySpec)
    assert isinstance(get_family("video_llava"), VideoLLaVAFamily)
    assert {n for n in BUILT_IN if isinstance(get_family(n), WanFamily)} == {"wan", "wan_ar"}
    assert {n for n in BUILT_IN if isinstance(get_family(n), DiffusionFamily)} == {
        "video_dit",
        "stdit",
        "ar_dit",
        "wan",
        "wan_ar",
    }
    # each family supplies its defaults: the objective, and whether it needs the VAE
    objectives = ["edm", "edm", "flow", "lm", "lm", "flow", "flow"]
    assert [get_family(n).default_objective for n in BUILT_IN] == objectives
    # Wan trains on precomputed Wan-VAE latents: not the project's VAE
    assert [get_family(n).needs_vae for n in BUILT_IN] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert get_family("stdit").layer_type == "stdit" and get_family("ar_dit").autoregressive


def test_unknown_family_names_it_and_the_registered_ones():
    with pytest.raises(
        ValueError,
        match=r"model.family \('unet'\) must be one of \('video_dit', "
        r"'stdit', 'ar_dit', 'qwen_vl', 'video_llava', 'wan', 'wan_ar'\)",
    ):
        get_family("unet")
    with pytest.raises(ValueError, match=r"model.family \(\['ar_dit'\]\) must be one of"):
        get_family(["ar_dit"])
    with pytest.raises(ValueError, match=r"model.family \('unet'\) must be one of"):
        validate(load_config(None, ["model.family=unet"]), 1)


def _toy_check(config, world_size):
    if config.model.num_layers != 2:
        raise ValueError(
            f"model.num_layers ({config.model.num_layers}) must be 2 for model.family 'toy'"
        )


def _toy(**kw):
    args = dict(
        name="toy",
        summary="a test family",
        objectives=("flow",),
        layer_type="full",
        autoregressive=False,
        model=VideoDiT,
        check=_toy_check,
    )
    return DiffusionFamily(**{**args, **kw})


def test_specs_are_built_by_keyword_only():
    with pytest.raises(TypeError):
        DiffusionFamily(
            "toy", "a test family", ("flow",), True, _toy_check, "full", False, VideoDiT
        )
    with pytest.raises(TypeError):  # the base is abstract: a family kind supplies the hooks
        FamilySpec(name="toy", summary="", objectives=("flow",), needs_vae=True, check=_toy_check)
    spec = _toy()
    assert spec.needs_vae and spec.default_objective == "flow"  # DiffusionFamily's own default
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(name=""), r"FamilySpec.name \(''\) must be a non-empty string"),
        (
            dict(objectives=()),
            r"FamilySpec.objectives \(\(\)\) of family 'toy' must be a non-empty "
            r"tuple of strings",
        ),
        (dict(objectives="flow"), r"FamilySpec.objectives \('flow'\) of family 'toy'"),
        (dict(check=None), r"FamilySpec.check \(None\) of family 'toy' must be callable"),
    ],
)
def test_bad_spec_fields_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        _toy(**kw)


def test_register_refuses_duplicates_and_non_specs(monkeypatch):
    monkeypatch.setattr(family_spec, "_FAMILIES", dict(family_spec._FAMILIES))
    with pytest.raises(
        ValueError,
        match=r"model.family 'ar_dit' is already registered "
        r"\(DiffusionFamily\)",
    ):
        register_family(_toy(name="ar_dit"))
    with pytest.raises(ValueError, match=r"spec \(dict\) must be a FamilySpec"):
        register_family({"name": "toy"})


def test_a_new_family_is_one_register_call(monkeypatch):
    """Registered, the family is what the config validates against (its rules, its objectives,
    its default objective) and what the model factory builds its TransformerConfig for."""
    monkeypatch.setattr(family_spec, "_FAMILIES", dict(family_spec._FAMILIES))
    spec = register_family(_toy(layer_type="stdit"))
    assert get_family("toy") is spec and family_names() == (*BUILT_IN, "toy")
    cfg = load_config(None, ["model.family=toy", "model.num_layers=2"])
    validate(cfg, 1)
    assert cfg.objective == "flow"
    assert transformer_config(cfg).layer_type == "stdit"
    assert spec.seq_length(cfg) == spec.sample_layout(cfg, 1).seq_length
    with pytest.raises(
        ValueError, match=r"model.num_layers \(4\) must be 2 for model.family 'toy'"
    ):
        validate(load_config(None, ["model.family=toy"]), 1)
    with pytest.raises(
        ValueError,
        match=r"diffusion.objective \('edm'\) must be 'flow' for "
        r"model.family 'toy'$",
    ):
        validate(
            load_config(
                None, ["model.family=toy", "model.num_layers=2", "diffusion.objective=edm"]
            ),
            1,
        )


def test_ar_dit_explains_its_objective():
    with pytest.raises(
        ValueError,
        match=r"diffusion.objective \('edm'\) must be 'flow' for "
        r"model.family 'ar_dit' \(teacher forcing trains with "
        r"flow matching\)",
    ):
        validate(load_config(None, ["diffusion.objective=edm"]), 1)


def test_built_in_families_load_on_first_lookup():
    """Importing the package, the config or the command line (and its --help) imports no model and
    not Megatron-Core; the first lookup loads the built-in families (a fresh interpreter). The data
    layer's plain-torch pieces under models/ (the caption vocabulary, the VAE halo probe) and the
    lazy models package itself are the only models modules allowed."""
    import subprocess
    import sys

    code = (
        "import contextlib, io, sys\n"
        "from megatron_video.training import cli\n"
        "from megatron_video.training.config import load_config\n"
        "load_config(None, ['model.family=wan'])\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "assert 'usage: megatron-video' in out.getvalue(), out.getvalue()\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('megatron.core', "
        "'megatron_video.models', 'megatron_video.training.families')) and m not in "
        "('megatron_video.models', 'megatron_video.models.captions', "
        "'megatron_video.models.vae_halo_probe', 'megatron_video.models.vae_geometry', "
        "'megatron_video.models.vae'))\n"  # vae: torch only (the strides vae_geometry reads)
        "assert not heavy, heavy\n"
        "from megatron_video.training.family_spec import get_family\n"
        "assert get_family('wan').name == 'wan'\n"
        "assert 'megatron.core' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
