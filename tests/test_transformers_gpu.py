"""cupyflash as transformers' attn_implementation on CUDA tensors, the kernels the models reach:
padded batches (left and right) of a GQA decoder and of an encoder, forward and a training
step's gradients; a padding-free packed batch; Mistral's sliding window and Gemma 2's softcap;
greedy generation with a dynamic and a static cache. Each result is judged by the tolerance rule
against the same model with torch's SDPA in float64 on the GPU, the baseline SDPA in the model's
dtype; no call of ours reaches torch's own attention."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
import cupyflash.transformers  # noqa: E402
from rule import assert_within_rule  # noqa: E402
import test_transformers  # noqa: E402

pytestmark = pytest.mark.gpu
calls = test_transformers.calls  # the fixture of the adapter's calls of cupyflash
llama = test_transformers.llama
IMPL = cupyflash.transformers.NAME
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture
def no_torch_attention(monkeypatch):
    """Counts the calls of torch's SDPA made while our model runs (`during`): a padded batch that
    fell back to torch would show here."""
    made = []
    during = [False]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        if during[0]:
            made.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    yield during
    assert not made, f"{len(made)} attention calls went to torch's SDPA"


def models(config, model_class, dtype, peer="sdpa"):
    """{name: model} on the GPU with the same weights: ours and the baseline (`peer`) in dtype,
    the exact one (`peer`) in float64."""
    base = model_class._from_config(copy.deepcopy(config), attn_implementation=peer).eval()
    built = {}
    for name, impl, precision in (("ours", IMPL, dtype), ("baseline", peer, dtype), ("exact", peer, torch.float64)):
        model = model_class._from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        model.load_state_dict(base.state_dict())
        built[name] = model.to("cuda", precision)
    return built


def outputs(built, during, select=lambda x: x, **inputs):
    results = {}
    inputs = {name: x.cuda() for name, x in inputs.items()}
    with torch.no_grad():
        for name, model in built.items():
            during[0] = name == "ours"
            out = model(**inputs)
            during[0] = False
            results[name] = select(out["logits"] if "logits" in out else out["last_hidden_state"])
    return results


def judge(results, dtype_name, name="logits"):
    assert_within_rule(name, results["ours"], results["exact"], results["baseline"], dtype_name)


def padding(batch: int, length: int, left: bool = True):
    """A mask with right padding in row 0 and, with `left`, left padding in row 1 (others
    unpadded)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length * 3 // 4:] = 0
    if left:
        mask[1, :length // 3] = 0
    return mask


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_padded_batches_of_a_gqa_decoder(rng, calls, no_torch_attention, dtype_name):
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama(), transformers.LlamaForCausalLM, DTYPES[dtype_name])
    ids = torch.randint(0, 97, (3, 203))
    judge(outputs(built, no_torch_attention, input_ids=ids), dtype_name)
    assert calls == ["dense", "dense"]
    mask = padding(3, 203)
    real = mask.bool().cuda()
    judge(outputs(built, no_torch_attention, lambda x: x[real], input_ids=ids, attention_mask=mask), dtype_name)
    assert calls[2:] == ["varlen", "varlen"]


def bert():
    return transformers.BertConfig(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("left", [False, True], ids=["right", "left and right"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_a_padded_encoder(rng, calls, no_torch_attention, dtype_name, left):
    """BERT (head dim 64) with right-padded rows (and a left-padded one): the dense kernels with
    each row's key count, every query computed in place (left padding's real keys moved first);
    the real tokens' hidden states within the rule."""
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(bert(), transformers.BertModel, DTYPES[dtype_name])
    ids = torch.randint(0, 97, (3, 113))
    mask = padding(3, 113, left)
    real = mask.bool().cuda()
    judge(outputs(built, no_torch_attention, lambda x: x[real], input_ids=ids, attention_mask=mask), dtype_name,
          "hidden states")
    assert calls == ["dense", "dense"]


@pytest.mark.parametrize("left", [False, True], ids=["right", "left and right"])
def test_a_padded_encoders_training_step(rng, calls, no_torch_attention, left):
    """The gradient of a padded BERT batch's masked-LM loss (padding labelled -100) reaching the
    first layer's query weights, through the dense backward with key counts."""
    torch.manual_seed(int(rng.integers(2**31)))
    config = bert()
    built = models(config, transformers.BertForMaskedLM, torch.float32)
    ids = torch.randint(0, 97, (3, 113)).cuda()
    mask = padding(3, 113, left).cuda()
    labels = ids.masked_fill(mask == 0, -100)
    grads = {}
    for name, model in built.items():
        model.zero_grad()
        no_torch_attention[0] = name == "ours"
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        no_torch_attention[0] = False
        grads[name] = model.bert.encoder.layer[0].attention.self.query.weight.grad
    judge(grads, "float32", "query gradient")
    assert calls == ["dense", "dense"]


def test_packed_sequences_without_padding(rng, calls, no_torch_attention):
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama(), transformers.LlamaForCausalLM, torch.bfloat16)
    lengths = [17, 113, 40]
    ids = torch.randint(0, 97, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = outputs(built, no_torch_attention, input_ids=ids, position_ids=positions)
    assert calls == ["varlen", "varlen"]
    alone = [outputs(built, no_torch_attention, input_ids=part) for part in ids.split(lengths, dim=1)]
    assert_within_rule("logits", packed["ours"], torch.cat([a["exact"] for a in alone], dim=1),
                       torch.cat([a["baseline"] for a in alone], dim=1), "bfloat16")


def test_sliding_window_and_softcap(rng, calls, no_torch_attention):
    torch.manual_seed(int(rng.integers(2**31)))
    mistral = transformers.MistralConfig(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, sliding_window=37,
                                         max_position_embeddings=512)
    ids = torch.randint(0, 97, (2, 203))
    judge(outputs(models(mistral, transformers.MistralForCausalLM, torch.bfloat16), no_torch_attention,
                  input_ids=ids), "bfloat16")
    gemma = transformers.Gemma2Config(vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      attn_logit_softcapping=20.0, sliding_window=37, max_position_embeddings=512)
    judge(outputs(models(gemma, transformers.Gemma2ForCausalLM, torch.bfloat16, peer="eager"), no_torch_attention,
                  input_ids=ids), "bfloat16")
    assert set(calls) == {"dense"} and len(calls) == 4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_greedy_generation_equals_sdpa(rng, calls, no_torch_attention, cache, padded):
    """Greedy tokens of our float32 model equal float64 SDPA's; unpadded steps after the prompt
    take the decode kernels, left-padded ones varlen."""
    torch.manual_seed(int(rng.integers(2**31)))
    built = models(llama(), transformers.LlamaForCausalLM, torch.float32)
    ids = torch.randint(0, 97, (2, 17)).cuda()
    mask = torch.ones(2, 17, dtype=torch.long).cuda()
    if padded:
        mask[1, :5] = 0
    tokens = {}
    for name in ("ours", "exact"):
        no_torch_attention[0] = name == "ours"
        with torch.no_grad():
            tokens[name] = built[name].generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                                pad_token_id=0, cache_implementation=cache)
        no_torch_attention[0] = False
    assert torch.equal(tokens["ours"], tokens["exact"])
    steps = 8 * 2  # (tokens x layers)
    if padded:
        assert calls.count("varlen") >= steps - 2 and "decode" not in calls
    else:
        assert calls.count("decode") >= steps - 2
