import json

import pytest
import torch

from fcsd.distill.data import DataError, load_texts, pack_sequences
from fcsd.distill.losses import forward_kl, next_token_nll
from fcsd.distill.tokenizer import train_tokenizer


def test_forward_kl_matches_definition_and_is_chunk_invariant():
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11), torch.randn(3, 5, 11)
    p = teacher.softmax(-1)
    expected = (p * (p.log() - student.log_softmax(-1))).sum()
    for chunk in (1, 4, 1000):
        total, count = forward_kl(student, teacher, chunk_size=chunk)
        torch.testing.assert_close(total, expected)
        assert count == 15
    same, _ = forward_kl(teacher, teacher)
    assert same.abs() < 1e-5


def test_forward_kl_mask_and_temperature():
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    total, count = forward_kl(student, teacher, mask=mask)
    expected, _ = forward_kl(student[mask], teacher[mask])
    assert count == 4
    torch.testing.assert_close(total, expected)
    hot, _ = forward_kl(student, teacher, temperature=2.0)
    p = (teacher / 2).softmax(-1)
    torch.testing.assert_close(hot, 4 * (p * (p.log() - (student / 2).log_softmax(-1))).sum())


def test_vocabulary_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        forward_kl(torch.randn(2, 5), torch.randn(2, 6))


def test_next_token_nll_matches_cross_entropy():
    logits, labels = torch.randn(2, 6, 9), torch.randint(0, 9, (2, 6))
    labels[0, 0] = -100
    total, count = next_token_nll(logits, labels, chunk_size=5)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 9), labels.view(-1), reduction="sum")
    torch.testing.assert_close(total, expected)
    assert count == 11


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["add 12 + 34", "sort 3 1 2", "reverse abc"] * 20, vocab_size=300)


def test_chat_rows_render_with_template_and_malformed_rows_are_skipped(tmp_path, tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "add 1 + 2"}, {"role": "assistant", "content": "3"}]},
        {"messages": [{"role": "user"}]},  # malformed: no content
        {"text": "plain text row"},
        {"text": ""},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    loaded = load_texts(str(path), tokenizer)
    assert loaded.texts == ["<|user|>add 1 + 2<|end|><|assistant|>3<|end|>", "plain text row"]
    assert loaded.skipped == 2


def test_unusable_dataset_names_file_and_fields(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl.*'text'.*'messages'"):
        load_texts(str(path), tokenizer)
    weird = tmp_path / "weird.xyz"
    weird.write_text("x")
    with pytest.raises(DataError, match="expected a .json"):
        load_texts(str(weird), tokenizer)


def test_pack_sequences(tokenizer):
    packed = pack_sequences(["add 12 + 34"] * 10, tokenizer, seq_len=8, max_sequences=3)
    assert packed.shape == (3, 8)
    assert (packed == tokenizer.eos_token_id).any()
    with pytest.raises(DataError, match="fewer than one sequence"):
        pack_sequences(["a"], tokenizer, seq_len=64)
