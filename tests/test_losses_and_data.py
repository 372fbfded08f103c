import json

import pytest
import torch

from fcsd.distill import losses
from fcsd.distill.data import DataError, load_texts, pack_documents, pack_sequences
from fcsd.distill.losses import forward_kl, next_token_nll
from fcsd.embedded.tokenizer import train_tokenizer


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


def _log_probs(logits):
    return torch.log_softmax(logits.double(), -1)


def test_divergences_match_their_definitions():
    student, teacher = torch.randn(6, 11), torch.randn(6, 11)
    s, t = _log_probs(student), _log_probs(teacher)
    forward = (t.exp() * (t - s)).sum(-1)
    reverse = (s.exp() * (s - t)).sum(-1)
    m = torch.log(0.3 * t.exp() + 0.7 * s.exp())
    jsd = 0.3 * (t.exp() * (t - m)).sum(-1) + 0.7 * (s.exp() * (s - m)).sum(-1)
    torch.testing.assert_close(losses.kl_divergence(student, teacher), forward.float())
    torch.testing.assert_close(losses.divergence("reverse_kl")(student, teacher), reverse.float())
    torch.testing.assert_close(losses.divergence("jsd", jsd_beta=0.3)(student, teacher), jsd.float())
    assert float(losses.jensen_shannon(student, student).abs().max()) < 1e-6
    with pytest.raises(ValueError, match="unknown divergence 'kl2'"):
        losses.divergence("kl2")


def test_topk_kl_is_exact_with_the_whole_vocabulary_and_a_bucketed_bound_otherwise():
    student, teacher = torch.randn(5, 13), torch.randn(5, 13)
    full = losses.kl_divergence(student, teacher)
    torch.testing.assert_close(losses.topk_forward_kl(student, *losses.topk_teacher(teacher, 13)), full)
    logp, ids = losses.topk_teacher(teacher, 4)
    s, t = _log_probs(student), _log_probs(teacher)
    s_top, t_top = s.gather(-1, ids), t.gather(-1, ids)
    t_rest, s_rest = 1 - t_top.exp().sum(-1), 1 - s_top.exp().sum(-1)
    expected = (t_top.exp() * (t_top - s_top)).sum(-1) + t_rest * (t_rest.log() - s_rest.log())
    bucketed = losses.topk_forward_kl(student, logp, ids)
    torch.testing.assert_close(bucketed, expected.float())
    assert (bucketed <= full + 1e-6).all()


@pytest.mark.parametrize("name", ["forward_kl", "jsd"])  # closed-form gradient, autograd gradient
def test_chunked_head_loss_matches_unchunked_values_and_gradients(name):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 17, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    teacher = torch.randn(10, 17)
    divergence = losses.divergence(name)
    total = losses.chunked_head_loss(hidden, head, divergence, (teacher,), chunk_size=3)
    total.backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    reference = divergence(head(hidden), teacher).sum()
    reference.backward()
    torch.testing.assert_close(total, reference)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], head.weight.grad)


def test_hidden_l2_is_the_summed_squared_distance():
    student = [torch.randn(2, 3, 4) for _ in range(3)]
    teacher = [torch.randn(2, 3, 4) for _ in range(3)]
    mask = torch.tensor([[True, False, True], [True, True, True]])
    expected = sum(((o - t) ** 2).sum(-1)[mask].sum() for o, t in zip(student, teacher, strict=True))
    torch.testing.assert_close(losses.hidden_l2(student, teacher, mask), expected)


def test_packing_resets_positions_per_document_and_labels_stay_inside_documents():
    packed = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13]], seq_len=4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0], [1, 0, 1, 2]]
    assert packed.sft_labels().tolist() == [[6, 7, -100, -100], [-100, 11, 12, -100]]


@pytest.mark.parametrize("attention", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "llama4_text"])
def test_packed_documents_do_not_attend_to_each_other(family, attention):
    """A packed row scores each document exactly as if it were alone (block-diagonal mask from position ids), with
    every attention kernel the trainer may load (sdpa is its default), Llama-4's chunked attention included."""
    from tiny_models import build

    import fcsd

    model = build(family).requires_grad_(False)  # flex attention has no CPU backward in torch 2.13
    model.set_attn_implementation(attention)
    model = fcsd.apply_farskip(model, "all")
    docs = [torch.randint(3, 90, (n,)).tolist() for n in (5, 7, 4)]
    packed = pack_documents(docs, seq_len=16)
    together = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0]
    start = 0
    for doc in docs:
        alone = model(input_ids=torch.tensor([doc])).logits[0]
        torch.testing.assert_close(together[start : start + len(doc)], alone, atol=1e-5, rtol=1e-5)
        start += len(doc)


def test_closed_form_kl_gradient_equals_autograd():
    student, teacher = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9)
    for temperature in (1.0, 2.0):
        loss, grad = losses.forward_kl_and_grad(student, teacher, temperature)
        reference = losses.kl_divergence(student, teacher, temperature)
        (expected,) = torch.autograd.grad(reference.sum(), student)
        torch.testing.assert_close(loss, reference.detach())
        torch.testing.assert_close(grad, expected)


def test_a_mismatched_teacher_cache_is_rebuilt_only_with_overwrite(tmp_path):
    """Without overwrite a mismatched cache is refused with a fix that works; with it the cache is rebuilt."""
    from tiny_models import build

    from fcsd.distill.teacher_cache import TeacherCacheError, build_cache, expected_meta

    teacher = build("qwen3_moe").requires_grad_(False)
    rows = pack_documents([torch.randint(3, 90, (n,)).tolist() for n in (9, 14, 11)], seq_len=8)
    folder = tmp_path / "cache"
    old = expected_meta(teacher, "data-a", len(rows), 8, 4, 1.0)
    build_cache(teacher, rows, folder, old, progress=False)
    new = expected_meta(teacher, "data-b", len(rows), 8, 4, 1.0)
    with pytest.raises(TeacherCacheError, match="add overwrite=true to this command to rebuild it"):
        build_cache(teacher, rows, folder, new, progress=False)
    build_cache(teacher, rows, folder, new, progress=False, overwrite=True)
    assert json.loads((folder / "meta.json").read_text())["data"] == "data-b"
    # a folder that merely holds a meta.json (a user's data folder, say) is never replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps(old))
    (foreign / "train.parquet").write_text("precious")
    with pytest.raises(ValueError, match="holds files fcsd did not write"):
        build_cache(teacher, rows, foreign, new, progress=False, overwrite=True)
    assert (foreign / "train.parquet").read_text() == "precious"


def test_teacher_token_loss_is_kl_of_the_teacher_from_the_student():
    """objectives.teacher_token_loss(divergence, teacher_head)(student_logits, teacher_hidden): the teacher's
    logits come from its head, and the loss is KL(teacher || student), not the reverse (asymmetric: a swap changes
    the value and the gradient), by both the autograd and the closed-form path."""
    from fcsd.distill.objectives import teacher_token_loss

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    teacher_hidden = torch.randn(5, 8, generator=gen)
    student_logits = (3 * torch.randn(5, 11, generator=gen)).requires_grad_(True)
    teacher_logp = torch.log_softmax(head(teacher_hidden).detach(), -1)
    student_logp = torch.log_softmax(student_logits, -1)
    expected = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    token_loss = teacher_token_loss(losses.divergence("forward_kl"), head)
    got = token_loss(student_logits, teacher_hidden)
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got.sum(), student_logits)
    torch.testing.assert_close(grad, student_logp.exp() - teacher_logp.exp())
    closed_loss, closed_grad = token_loss.loss_and_grad(student_logits.detach(), teacher_hidden)
    torch.testing.assert_close(closed_loss, expected.detach())
    torch.testing.assert_close(closed_grad, grad)
    assert head.weight.grad is None  # no gradient into the teacher


def test_one_numeric_content_or_nan_drops_only_the_bad_rows(tmp_path, tokenizer, caplog):
    """datasets types a column of strings and numbers as Json, which gave the string "6" back as the int 6: one int
    content dropped every numeric-looking row. Now exactly the bad rows are skipped and "6" is kept as text."""

    def chat(answer):
        return {"messages": [{"role": "user", "content": "add 3 + 3"}, {"role": "assistant", "content": answer}]}

    rows = [chat(12), chat("6"), chat("6"), chat("Infinity"), chat("abc")]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_texts(str(tmp_path / "chat.jsonl"))
    assert loaded.skipped == 1 and "skipped 1 malformed or empty rows of 5" in caplog.text
    assert [t.rsplit(": ", 1)[1] for t in loaded.texts] == ["6", "6", "Infinity", "abc"]
    (tmp_path / "text.jsonl").write_text('{"text": NaN}\n{"text": "6"}\n{"text": Infinity}\n{"text": "1e3"}\n')
    loaded = load_texts(str(tmp_path / "text.jsonl"), max_rows=3)
    assert loaded.texts == ["6"] and loaded.skipped == 2
