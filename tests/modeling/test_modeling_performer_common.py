"""transformers' own common model and configuration tests (``ModelTesterMixin``, ``ConfigTester``, from
the source distribution of the installed transformers: see ``transformers_common.py``), run on a tiny
config for each attention method: exact, FAVOR+ and hybrid.

Where linear attention legitimately differs from softmax attention, a test is skipped with its reason
in the test class, as transformers' own model tests do.
"""

import unittest
from unittest import mock

from transformers.models.auto import modeling_auto

from performer_hf import (
    PerformerConfig,
    PerformerForCausalLM,
    PerformerForMaskedLM,
    PerformerForQuestionAnswering,
    PerformerForSequenceClassification,
    PerformerForTokenClassification,
    PerformerModel,
)

from .. import transformers_common

common = transformers_common.load("test_modeling_common")
ConfigTester = transformers_common.load("test_configuration_common").ConfigTester

METHODS = {
    "exact": {"attention_kernel": "exact"},
    "favor": {"attention_kernel": "softmax", "nb_features": 16, "causal_chunk_size": 4},
    # one setting that serves every head, the causal one included (routing would read future tokens)
    "hybrid": {
        "attention_kernel": "poly2",
        "center_features": True,
        "local_window": 3,
        "num_global_tokens": 1,
        "routed_blocks": 0,
        "causal_chunk_size": 4,
    },
}


class PerformerModelTester:
    """Tiny configs and inputs in the layout transformers' ``ModelTesterMixin`` expects."""

    def __init__(self, parent, method: str, batch_size=13, seq_length=7, vocab_size=99, hidden_size=32):
        self.parent = parent
        self.method = method
        self.batch_size, self.seq_length = batch_size, seq_length
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = 2, 4
        self.is_training = True

    def get_config(self) -> PerformerConfig:
        return PerformerConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=37,
            max_position_embeddings=512,
            type_vocab_size=16,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
            num_labels=3,
            pad_token_id=0,
            **METHODS[self.method],
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = common.random_attention_mask([self.batch_size, self.seq_length])
        token_type_ids = common.ids_tensor([self.batch_size, self.seq_length], 16)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.get_config(), inputs


# The mixin finds each head's task (which labels to pass, which heads to train) in transformers' own
# name tables; registering with the Auto classes (what `import performer_hf` does) does not add to them.
_TASK_TABLES = {
    "MODEL_MAPPING_NAMES": "PerformerModel",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": "PerformerForMaskedLM",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": "PerformerForCausalLM",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": "PerformerForSequenceClassification",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": "PerformerForTokenClassification",
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": "PerformerForQuestionAnswering",
}


class _PerformerCommonTests(common.ModelTesterMixin):
    method: str
    all_model_classes = (
        PerformerModel,
        PerformerForMaskedLM,
        PerformerForCausalLM,
        PerformerForSequenceClassification,
        PerformerForTokenClassification,
        PerformerForQuestionAnswering,
    )

    @unittest.skip(
        "transformers' GenerationTesterMixin is not in its sdist: test_modeling_performer_generation.py checks cached "
        "decoding against a full forward for every method instead (greedy, sampling, beam search, padded or not)"
    )
    def test_generation_tester_mixin_inheritance(self):
        pass

    @classmethod
    def setUpClass(cls):
        cls._tables = [
            mock.patch.dict(getattr(modeling_auto, table), {"performer": name}) for table, name in _TASK_TABLES.items()
        ]
        for patch in cls._tables:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._tables:
            patch.stop()

    def setUp(self):
        self.model_tester = PerformerModelTester(self, self.method)
        self.config_tester = ConfigTester(self, config_class=PerformerConfig, hidden_size=48, **METHODS[self.method])

    def test_config(self):
        self.config_tester.run_common_tests()


class PerformerExactModelTest(_PerformerCommonTests, unittest.TestCase):
    method = "exact"


class PerformerFavorModelTest(_PerformerCommonTests, unittest.TestCase):
    method = "favor"
    has_attentions = False  # linear attention never forms the (L x L) attention matrix


class PerformerHybridModelTest(_PerformerCommonTests, unittest.TestCase):
    method = "hybrid"
    has_attentions = False  # the far field never forms the (L x L) attention matrix
