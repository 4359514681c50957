"""cupyflash as transformers' attn_implementation (cupyflash.transformers), on CPU tensors (the
NumPy path): Llama-style GQA decoders plain, left- and right-padded and packed without padding,
a Mistral sliding window, Gemma 2's softcap, a BERT encoder with padding, greedy generation, and
a training step's gradients. Each is judged by the tolerance rule against the same model with
torch's SDPA in float64, the baseline SDPA in float32 (eager attention for the softcap, which SDPA
does not apply; eager's float64 padding mask turns a left-padded row into NaN)."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import cupyflash.transformers  # noqa: E402
from cupyflash.frameworks import transformers as adapter  # noqa: E402
from rule import assert_within_rule  # noqa: E402

IMPL = cupyflash.transformers.NAME


def llama(**extra):
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra)


def models(config, model_class=transformers.LlamaForCausalLM, peer="sdpa"):
    """{name: model}: ours in float32, `peer` attention in float32 (the baseline) and float64 (the
    exact one), all with the same weights."""
    base = model_class._from_config(copy.deepcopy(config), attn_implementation=peer).eval()
    built = {}
    for name, impl, dtype in (("ours", IMPL, torch.float32), ("baseline", peer, torch.float32),
                              ("exact", peer, torch.float64)):
        model = model_class._from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        model.load_state_dict(base.state_dict())
        built[name] = model.to(dtype)
    assert built["ours"].config._attn_implementation == IMPL
    return built


@pytest.fixture
def calls(monkeypatch):
    """The adapter's calls of cupyflash ("dense", "varlen", "decode"): a model that never reaches
    cupyflash fails the tests that expect it."""
    seen = []
    for name, label in (("attention", "dense"), ("attention_varlen", "varlen"), ("attention_decode", "decode")):
        real = getattr(adapter.adapter, name)
        monkeypatch.setattr(adapter.adapter, name, lambda *a, _real=real, _label=label, **k: (
            seen.append(_label), _real(*a, **k))[1])
    return seen


def outputs(built, select=lambda x: x, **inputs):
    """{name: the model's logits (or last hidden state)}, through `select`."""
    results = {}
    with torch.no_grad():
        for name, model in built.items():
            out = model(**inputs)
            results[name] = select(out["logits"] if "logits" in out else out["last_hidden_state"])
    return results


def judge(results, name="logits"):
    assert_within_rule(name, results["ours"], results["exact"], results["baseline"], "float32")


def test_plain_and_padded_batches(rng, calls):
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama())
    ids = torch.randint(0, 97, (3, 37))
    judge(outputs(built, input_ids=ids))
    assert calls == ["dense", "dense"]
    mask = torch.ones(3, 37, dtype=torch.long)
    mask[0, 29:] = 0  # right padding
    mask[1, :11] = 0  # left padding
    real = mask.bool()
    judge(outputs(built, lambda x: x[real], input_ids=ids, attention_mask=mask))
    assert calls[2:] == ["varlen", "varlen"]


def test_packed_sequences_without_padding(rng, calls):
    """One row of three concatenated sequences, position ids restarting at each: each sequence
    attends to itself only, as when it runs alone."""
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama())
    lengths = [9, 20, 14]
    ids = torch.randint(0, 97, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = outputs(built, input_ids=ids, position_ids=positions)
    assert calls == ["varlen", "varlen"]
    alone = [outputs(built, input_ids=part) for part in ids.split(lengths, dim=1)]
    assert_within_rule("logits", packed["ours"], torch.cat([a["exact"] for a in alone], dim=1),
                       torch.cat([a["baseline"] for a in alone], dim=1), "float32")


def test_sliding_window_and_softcap(rng, calls):
    torch.manual_seed(int(rng.integers(2**31)))
    mistral = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, sliding_window=6,
                                         max_position_embeddings=256)
    ids = torch.randint(0, 97, (2, 30))
    judge(outputs(models(mistral, transformers.MistralForCausalLM), input_ids=ids))
    gemma = transformers.Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      attn_logit_softcapping=0.1, sliding_window=8, max_position_embeddings=256)
    judge(outputs(models(gemma, transformers.Gemma2ForCausalLM, peer="eager"), input_ids=ids))
    assert set(calls) == {"dense"} and len(calls) == 4


@pytest.mark.parametrize("padding", ["right", "left and right"])
def test_a_padded_encoder(rng, calls, padding):
    """An encoder's padded batch takes the dense kernels with each sequence's key count; left
    padding's real keys are moved first."""
    torch.manual_seed(int(rng.integers(2**31)))
    bert = transformers.BertConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=128)
    ids = torch.randint(0, 97, (3, 25))
    mask = torch.ones(3, 25, dtype=torch.long)
    mask[0, 17:] = 0
    mask[2, 3:] = 0
    if padding != "right":
        mask[1, :6] = 0
    real = mask.bool()
    judge(outputs(models(bert, transformers.BertModel), lambda x: x[real], input_ids=ids, attention_mask=mask),
          "hidden states")
    assert calls == ["dense", "dense"]


@pytest.mark.parametrize("model", ["encoder", "decoder"])
def test_a_padded_batch_is_unpadded_once_per_forward(rng, monkeypatch, model):
    """The layers of a forward get one mask tensor: what the kernels need of it is found once
    (each nonzero() or torch.equal waits for the GPU); a new mask (or the same one written in
    place) is read again. An encoder's key counts stay on the GPU; a decoder's varlen lengths are
    read to the host once."""
    made, read = [], []
    from cupyflash.frameworks import torch_calls

    name = "_real_keys_first" if model == "encoder" else "_rows_and_lengths"
    make, host_lengths = getattr(adapter, name), torch_calls.host_lengths
    monkeypatch.setattr(adapter, name, lambda *a: made.append(1) or make(*a))
    monkeypatch.setattr(torch_calls, "host_lengths", lambda x: read.append(id(x)) or host_lengths(x))
    torch.manual_seed(int(rng.integers(2**31)))
    if model == "encoder":
        config = transformers.BertConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, max_position_embeddings=128)
        built = transformers.BertModel._from_config(config, attn_implementation=IMPL).eval()
    else:
        config = llama()
        config.num_hidden_layers = 3
        built = transformers.LlamaForCausalLM._from_config(config, attn_implementation=IMPL).eval()
    ids = torch.randint(0, 97, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 11:] = 0
    select = (lambda out: out.last_hidden_state) if model == "encoder" else (lambda out: out.logits)
    with torch.no_grad():
        first = select(built(input_ids=ids, attention_mask=mask))
        assert len(made) == 1
        assert (len(read), len(set(read))) == ((0, 0) if model == "encoder" else (3 * 2, 2))  # q's and k's lengths
        mask[1, 11:15] = 1  # the same tensor, written: read again
        second = select(built(input_ids=ids, attention_mask=mask))
    assert len(made) == 2
    assert not torch.equal(first[1, 11:15], second[1, 11:15])


def test_host_lengths_are_read_once_per_tensor_and_version():
    from cupyflash.frameworks import torch_calls

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = torch_calls.host_lengths(cu)
    assert torch_calls.host_lengths(cu) is first and not first.flags.writeable
    cu[2] = 9
    again = torch_calls.host_lengths(cu)
    assert again is not first and again.tolist() == [0, 3, 9]


@pytest.mark.parametrize("decoder_length", [20, 9])
def test_cross_attention_of_an_encoder_decoder(rng, calls, decoder_length):
    """BART with a padded encoder batch (right and left): the decoder's cross-attention reads the
    encoder's mask for its keys only, its own queries all real, also when the lengths are equal."""
    torch.manual_seed(int(rng.integers(2**31)))
    bart = transformers.BartConfig(vocab_size=97, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_position_embeddings=64)
    ids = torch.randint(3, 97, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 14:] = 0
    mask[1, :5] = 0
    decoder_ids = torch.randint(3, 97, (2, decoder_length))
    judge(outputs(models(bart, transformers.BartForConditionalGeneration), input_ids=ids, attention_mask=mask,
                  decoder_input_ids=decoder_ids))
    assert set(calls) == {"dense"} and len(calls) == 3


@pytest.mark.parametrize("prompt", [12, 20])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["left", "none"])
def test_greedy_generation_equals_sdpa(rng, calls, cache, padding, prompt, monkeypatch):
    """Greedy tokens equal float64 SDPA's. Without padding every step after the prompt (and, with
    a static cache, a prompt of up to 16 tokens too: its keys are the cache's first rows) takes the
    decode kernels; left-padded steps take varlen. A step's mask is read once, not once a layer.
    (A static cache whose all-ones mask generate drops is read up to the position ids.)"""
    prefixes = []
    prefix_lengths = adapter._prefix_lengths
    monkeypatch.setattr(adapter, "_prefix_lengths", lambda mask: prefixes.append(1) or prefix_lengths(mask))
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama())
    ids = torch.randint(0, 97, (2, prompt))
    mask = torch.ones(2, prompt, dtype=torch.long)
    if padding == "left":
        mask[1, :4] = 0  # as generation pads
    tokens = {}
    for name in ("ours", "exact"):
        with torch.no_grad():
            tokens[name] = built[name].generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                                pad_token_id=0, cache_implementation=cache)
    assert torch.equal(tokens["ours"], tokens["exact"])
    steps = 8 * 2  # (tokens x layers)
    assert len(prefixes) <= 8
    if padding == "none":
        assert calls.count("decode") >= steps - 2
    else:
        assert calls.count("varlen") >= steps - 2 and "decode" not in calls


def test_a_training_step(rng):
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama())
    ids = torch.randint(0, 97, (2, 24))
    grads = {}
    for name, model in built.items():
        model.train()
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads[name] = model.model.layers[0].self_attn.q_proj.weight.grad
    judge(grads, "q_proj gradient")


def test_what_it_does_not_take_says_so():
    built = models(llama())["ours"]
    with pytest.raises(NotImplementedError, match="output_attentions"):
        built(input_ids=torch.zeros(1, 5, dtype=torch.long), output_attentions=True)
