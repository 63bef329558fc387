"""A tiny Llama and a synthetic token data set for tests/test_transformers_trainer.py.

Imports torch and transformers only (not pagedopt): the fresh-process checks import this module
before anything has imported or registered pagedopt.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback  # noqa: E402

VOCAB, SEQ, N_SEQ, BATCH = 128, 16, 32, 4
# Embedding and lm_head have VOCAB * 32 = 4096 elements and each MLP matrix 32 * 128 = 4096: at
# the default min_8bit_size (4096) they get 8-bit states from an 8-bit optimizer, the attention
# matrices (32 * 32) and the norms 32-bit ones.
CONFIG = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)


def make_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


class Tokens(torch.utils.data.Dataset):
    """N_SEQ random sequences of SEQ token ids in [1, VOCAB) (never all zeros), labels = inputs."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (N_SEQ, SEQ), generator=g)

    def __len__(self):
        return N_SEQ

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CountSteps(TrainerCallback):
    """Counts the optimizer steps a train() call makes."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def run_kwargs(output_dir: str, max_steps: int, save_steps: int, seed: int) -> dict:
    """TrainingArguments of the tests' runs: CPU, no reporting, checkpoints every save_steps."""
    return dict(output_dir=output_dir, max_steps=max_steps, save_strategy="steps", save_steps=save_steps,
                per_device_train_batch_size=BATCH, use_cpu=True, report_to=[], seed=seed,
                logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


def make_tokenizer():
    """A word-level tokenizer over the VOCAB ids, made here (no hub): TRL's SFTTrainer needs one for
    its pad token even when the data set is already token ids. Id 0 pads, 1 ends a sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
