"""Performer settings given to ``from_pretrained`` of a folder converted in place as keywords (``local_window=16``,
the Performer family's form): refused by name, with the form that works, with performer_hf imported and by the
folder's own code where it is not."""

import functools
import os
import re
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

import performer_hf
from performer_hf.modeling.modeling_in_place import IN_PLACE_CLASSES

from ..remote_code import BLOCK_PERFORMER_HF
from .test_attention_interface import DECODERS, _source

pytestmark = pytest.mark.usefixtures("single_thread")

# what a settings keyword is told (before: "TypeError: LlamaForCausalLM.__init__() got an unexpected keyword argument
# 'local_window'", naming neither config.performer_attention nor how to change it)
REFUSAL = (
    r"LlamaForCausalLM \(converted in place\) keeps its Performer settings in config.performer_attention.*"
    r"local_window, num_global_tokens cannot be given as keywords.*"
    r"config.performer_attention.update\(local_window=16, num_global_tokens=2\).*"
    r"performer_attention=\{'attention_method': 'hybrid', 'local_window': 16, 'num_global_tokens': 2\}"
)

# argv = the folder; prints the error's type and message, loading with the settings as keywords
_SCRIPT = BLOCK_PERFORMER_HF + textwrap.dedent(
    """
    from transformers import AutoModelForCausalLM

    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, local_window=16, num_global_tokens=2)
    except Exception as error:
        print(f"ERROR{type(error).__name__}: {error}")
    """
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("in_place")
    _, source = _source(DECODERS["llama"], tmp_path)
    return performer_hf.convert(source, tmp_path / "out", fidelity=False, method="hybrid", local_window=8)


@pytest.mark.parametrize("shipped", [True, False], ids=["folders_code", "performer_hf_class"])
def test_settings_as_keywords_are_refused_naming_the_form_that_works(folder, shipped):
    """By the folder's code (trust_remote_code=True) or performer_hf's class of it. (Loaded as transformers' own
    class, without trust_remote_code, the keyword reaches transformers' constructor, not these classes: its TypeError
    stays.)"""
    load = (
        functools.partial(AutoModelForCausalLM.from_pretrained, trust_remote_code=True)
        if shipped
        else IN_PLACE_CLASSES["LlamaForCausalLM"].from_pretrained
    )
    with pytest.raises(ValueError, match=REFUSAL):
        load(folder, local_window=16, num_global_tokens=2)
    # the form it names: the folder's settings, those two changed
    config = AutoConfig.from_pretrained(folder)
    kept = dict(config.performer_attention)
    config.performer_attention.update(local_window=16, num_global_tokens=2)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config)
    assert model.config.performer_attention == {**kept, "local_window": 16, "num_global_tokens": 2}
    # a keyword the source's config has a field for still loads
    assert AutoModelForCausalLM.from_pretrained(folder, rms_norm_eps=1e-5).config.rms_norm_eps == 1e-5


def test_the_folders_own_code_refuses_them_where_performer_hf_is_absent(folder, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", _SCRIPT, str(folder)]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    error = result.stdout.split("ERROR", 1)[1]
    assert error.startswith("ValueError: ") and re.search(REFUSAL, error), error
