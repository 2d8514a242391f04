"""Images end to end (#34 part D; docs/vision.md, "Images in chat, the CLI and the server"): the chat template's
image placeholders expanded and filled by the vision tower, M-RoPE positions, the prefix cache and transcripts
across an image turn, `Model.generate(images=)`, the server (openai client, base64 images, streamed and not,
batched) and the CLI's ``--image``.

Oracle: transformers' ``Qwen3_5MoeForConditionalGeneration.from_pretrained`` of the ``tiny-vl`` hf-bf16 fixture
(float32) on our `preprocess` output (which tests/test_images.py checks against transformers' processor), for
one and two images, and mlx-vlm's qwen3_5_moe Model (MLX CPU, float32) loaded from the mlx-bf16 fixture with the
tower, fed the same input_ids / pixel_values / image_grid_thw; the cpu engine and metal-sim against the reference. The fixture's preprocessor_config.json
here keeps images small (min_pixels 4096: a 40 x 60 image becomes 4 x 6 patches, 6 image tokens)."""
from __future__ import annotations

import base64
import io
import json
import sys
import threading

import numpy as np
import pytest
from PIL import Image

import qwenmetal as qm
from live_server import live_server
from oracles import require
from qwenmetal.chat import chat_turn
from qwenmetal.errors import ImageError, InputError
from qwenmetal.sampling import Sampler, SampleResult
from qwenmetal.testing import SPECIAL_TOKENS, cached_checkpoint

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
NAME = "tiny-vl"


def png(seed: int, h: int = 40, w: int = 60) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def data_url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def user(*parts) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    return {"role": "user", "content": content}


def small_images(src, tmp_path_factory):
    """A checkpoint folder of links to `src`'s files, plus a preprocessor_config.json that keeps images small."""
    dst = tmp_path_factory.mktemp("vl") / "ck"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 4096, "longest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return dst


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The tiny-vl hf-bf16 fixture (a tower under model.visual.*) with a small-image preprocessor_config.json."""
    return small_images(cached_checkpoint("tiny-vl", "hf-bf16"), tmp_path_factory)


@pytest.fixture(scope="module")
def vl_mlx(tmp_path_factory):
    """The tiny-vl mlx-bf16 fixture with the tower kept (mlx-vlm's layout: vision_tower.*), small images."""
    return small_images(cached_checkpoint("tiny-vl", "mlx-bf16", vision=True), tmp_path_factory)


@pytest.fixture(scope="module")
def ref(vl):
    return qm.Model.load(vl, backend="reference")


@pytest.fixture(scope="module")
def hf(vl):
    torch = require("torch")
    require("transformers")
    from transformers import Qwen3_5MoeForConditionalGeneration
    torch.set_num_threads(2)
    return Qwen3_5MoeForConditionalGeneration.from_pretrained(str(vl), dtype=torch.float32).eval()


CASES = {"one image": (png(1),), "two images": (png(1), png(2, 64, 32))}


def case_turn(model, images):
    return chat_turn(model, [user("Look at", *images, "and describe it.")], enable_thinking=False)


def prefill_pieces(model, placed, piece: int | None = None):
    """The prompt's logits, prefilled at once or in pieces of `piece` rows (cutting the images) with the
    rows / positions `PromptImages.prefill_inputs` gives each piece."""
    s = model.new_session()
    n = len(placed.ids)
    step = piece or n
    out = []
    for a in range(0, n, step):
        b = min(n, a + step)
        out.append(model.prefill(s, placed.ids[a:b], "all", **placed.prefill_inputs(model, a, b, 0)))
    return s, np.concatenate(out)


# ---- the prompt against transformers ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_image_prompt_matches_transformers(ref, hf, case):
    """The chat template's placeholders expanded to each image's tokens, the tower's rows at the pads and
    get_rope_index's positions: the reference's logits equal transformers' (input_ids + pixel_values +
    image_grid_thw) at every row; `Model.chat` answers with transformers' greedy token."""
    torch = require("torch")
    turn = case_turn(ref, CASES[case])
    placed = turn.images
    pad = SPECIAL_TOKENS["<|image_pad|>"]
    assert [s.end - s.start for s in placed.spans] == list(placed.batch.n_tokens) and set(placed.batch.n_tokens) == {6}
    assert all(placed.ids[s.start - 1] == SPECIAL_TOKENS["<|vision_start|>"] and
               placed.ids[s.end] == SPECIAL_TOKENS["<|vision_end|>"] for s in placed.spans)
    assert placed.ids.count(pad) == 6 * len(CASES[case])
    with torch.no_grad():
        ids = torch.tensor([placed.ids])
        want = hf(input_ids=ids, pixel_values=torch.from_numpy(placed.batch.pixel_values),
                  image_grid_thw=torch.from_numpy(placed.batch.grid_thw),
                  mm_token_type_ids=(ids == pad).long()).logits[0].numpy()    # 1: an image token
    s, got = prefill_pieces(ref, placed)
    err = np.abs(got - want).max() / (want.max() - want.min())
    assert err < 1e-4, err                         # observed ~6e-6 of the logit range
    assert s.rope_delta < 0 and [tuple(x) for x in s.images] == [tuple(x) for x in placed.spans]
    r = ref.chat([user("Look at", *CASES[case], "and describe it.")], max_tokens=1, temperature=0,
                 enable_thinking=False, cache=False)
    assert r.tokens == [int(np.argmax(want[-1][:ref.sampleable_vocab]))]


@pytest.fixture(scope="module")
def mlx_vlm_model(vl_mlx):
    """mlx-vlm's own loader (`mlx_vlm.utils.load_model`: its Model class, sanitize and strict load) of the
    mlx-bf16 fixture, every bfloat16 parameter then cast to float32 (exact), run on MLX's CPU backend."""
    mx = require("mlx.core")
    require("mlx_vlm")
    from mlx.utils import tree_flatten, tree_map
    from mlx_vlm.utils import load_model
    m = load_model(vl_mlx)
    m.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, m.parameters()))
    assert {v.dtype for _, v in tree_flatten(m.parameters())} == {mx.float32}
    return m


@pytest.mark.parametrize("case", list(CASES))
def test_image_prompt_matches_mlx_vlm(vl_mlx, mlx_vlm_model, case):
    """The same prompt through mlx-vlm's qwen3_5_moe Model (its tower, masked_scatter of the features at the
    pads, its get_rope_index and language model), fed our input_ids and our `preprocess` output as its
    pixel_values / image_grid_thw (mlx-vlm's processor is not involved: it takes them as transformers' processor
    returns them, which is what `preprocess` matches): the reference's logits at every row, the same rope delta."""
    mx = require("mlx.core")
    ref = qm.Model.load(vl_mlx, backend="reference")
    placed = case_turn(ref, CASES[case]).images
    s, want = prefill_pieces(ref, placed)
    ids = mx.array([placed.ids])
    kw = dict(pixel_values=mx.array(placed.batch.pixel_values), image_grid_thw=mx.array(placed.batch.grid_thw))
    got = np.array(mlx_vlm_model(ids, **kw).logits[0])
    assert got.shape == want.shape
    err = np.abs(got - want).max() / (want.max() - want.min())
    assert err < 1e-4, err                          # observed ~6e-6 of the logit range
    feats = mlx_vlm_model.get_input_embeddings(ids, kw["pixel_values"], image_grid_thw=kw["image_grid_thw"])
    assert int(np.array(feats.rope_deltas).reshape(-1)[0]) == s.rope_delta


# ---- the engines against the reference ---------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "metal-sim"])
def test_engines_match_reference_with_images(vl, ref, backend):
    """Two images, prefilled in pieces of 5 rows (each image is cut), on cpu (its own tower) and metal-sim (the
    numpy tower over the same weights): within 1e-4 of the reference's logit range; the same delta and spans."""
    placed = case_turn(ref, CASES["two images"]).images
    s0, want = prefill_pieces(ref, placed)
    kw = dict(kv_dtype="float32", threads=2, prefill_chunk=8, activations="float") if backend == "cpu" else \
        dict(prefill_chunk=8)
    model = qm.Model.load(vl, backend=backend, **kw)
    s, got = prefill_pieces(model, case_turn(model, CASES["two images"]).images, piece=5)
    assert np.abs(got - want).max() / (want.max() - want.min()) < 1e-4      # observed ~3e-6
    assert s.rope_delta == s0.rope_delta and s.images == s0.images       # the cut images' spans are joined
    a = ref.decode_step(s0, 7)
    b = model.decode_step(s, 7)
    assert np.abs(a - b).max() / (a.max() - a.min()) < 1e-4


# ---- the prefix cache and transcripts ------------------------------------------------------------------------
class Scripted(Sampler):
    """A sampler that answers with fixed tokens (the reply ends on <|im_end|>, so its transcript is kept)."""

    def __init__(self, tokens):
        super().__init__(temperature=0.0)
        self.tokens = list(tokens)

    def sample(self, logits, vocab_used=None, **kw):
        return SampleResult(self.tokens.pop(0), None, None)


def test_second_turn_resumes_an_image_conversation(vl):
    """Turn 1 has an image; turn 2 (its reply + a new question) prefills only what follows the reply's fed
    tokens: the image is neither re-encoded nor re-prefilled, and the answer's logits are those of a cold run.
    The same conversation with another image of the same size shares only the text before the image."""
    model = qm.Model.load(vl, backend="reference")
    img, other = png(5), png(6)
    msgs = [user("Describe", img)]
    r1 = model.chat(msgs, sampler=Scripted([65, 66, SPECIAL_TOKENS["<|im_end|>"]]), max_tokens=3,
                    enable_thinking=False)
    n1 = r1.stats["prompt_tokens"]
    assert r1.stats["images"] == 1 and r1.stats["cached_tokens"] == 0
    msgs2 = msgs + [r1.message, user("And the colours?")]
    t2 = chat_turn(model, msgs2, enable_thinking=False)
    assert t2.prompt_ids[:n1 + 3] == model.transcripts.get(t2.keys[1])        # continues the transcript
    encoded = []
    enc = model.vision_encoder()
    real = enc.encode
    enc.encode = lambda *a: encoded.append(1) or real(*a)
    try:
        r2 = model.chat(msgs2, max_tokens=1, temperature=0, logprobs=True, enable_thinking=False)
    finally:
        enc.encode = real
    assert r2.stats["cached_tokens"] == n1 + 2                                 # prompt + the two fed reply tokens
    assert r2.stats["prefill_tokens"] == len(t2.prompt_ids) - (n1 + 2) and not encoded
    cold = model.generate(t2.prompt_ids, images=t2.images, max_tokens=1, temperature=0, logprobs=True,
                          cache=False)
    c = list(cold)[-1]
    assert c.token == r2.tokens[0] and abs(c.logprob - r2.logprobs[0]) < 1e-3
    # another image of the same size: the same pad ids, another digest -- no reuse past the image's start
    r3 = model.chat([user("Describe", other)], max_tokens=1, temperature=0, enable_thinking=False)
    start = t2.images.spans[0].start
    assert r3.stats["cached_tokens"] <= start


def test_chat_session_with_an_image_saves_and_resumes(vl, tmp_path):
    """`Model.chat_session` of a conversation with an image (metadata names it by its hash), saved and loaded
    into a fresh model: the next turn prefills only its new messages."""
    model = qm.Model.load(vl, backend="reference")
    msgs = [user("Describe", png(7)), {"role": "assistant", "content": "Noise."}]
    s = model.chat_session(msgs, enable_thinking=False)
    assert len(s.images) == 1 and s.rope_delta < 0
    assert json.dumps(s.metadata)                  # the image part is {"type": "image", "digest": ...}
    s.save(tmp_path / "c.safetensors")
    fresh = qm.Model.load(vl, backend="reference")
    loaded = qm.Session.load(tmp_path / "c.safetensors", fresh)
    assert loaded.images == s.images and loaded.rope_delta == s.rope_delta
    r = fresh.chat(msgs + [{"role": "user", "content": "More?"}], max_tokens=1, temperature=0,
                   enable_thinking=False)
    assert r.stats["cached_tokens"] == s.position                  # all of the saved conversation
    assert r.stats["prefill_tokens"] == r.stats["prompt_tokens"] - s.position


# ---- Model.generate with images; errors --------------------------------------------------------------------
def test_generate_with_images_and_bad_inputs(vl, ref):
    """A raw prompt with placeholders, `images=`; every bad input is refused before any work, naming it, and
    leaves the session and the cache as they were."""
    prompt = f"<|im_start|>user\n{PLACEHOLDER}{PLACEHOLDER}Compare.<|im_end|>\n<|im_start|>assistant\n"
    outs = list(ref.generate(prompt, images=list(CASES["two images"]), max_tokens=2, temperature=0, cache=False))
    assert outs[-1].stats["images"] == 2 and outs[-1].stats["prompt_tokens"] == len(ref.tokenizer.encode(prompt)) + 10
    s = ref.new_session()
    ref.prefill(s, [1, 2, 3], "none")
    before = (s.position, s.tokens, s.rope_delta)
    n_cached = len(ref.prefix_cache)
    bad = [
        (dict(images=[b"not an image"]), ImageError, "cannot be decoded|not an image|unidentified|corrupt"),
        (dict(images=["https://example.com/a.png"]), ImageError, "never fetches"),
        (dict(images=[png(1)] * 3), InputError, "3 image\\(s\\) given but the prompt has 2 placeholder"),
        (dict(images=[png(1)]), InputError, "more image placeholders"),
        (dict(images=list(CASES["two images"]), speculative="lookup"), InputError, "speculative decoding does not take"),
    ]
    for kw, err, match in bad:
        with pytest.raises(err, match=match):
            list(ref.generate(prompt, session=s, max_tokens=2, **kw))
        assert (s.position, s.tokens, s.rope_delta) == before and len(ref.prefix_cache) == n_cached
    with pytest.raises(InputError, match="http.*URL; qwenmetal never fetches") as e:
        ref.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    assert e.value.param == "messages[0].content[0]"
    with pytest.raises(InputError, match=r"messages\[1\]\.content\[0\]: images go in user messages"):
        ref.chat([user("hi"), {"role": "assistant", "content": [{"type": "image", "image": png(1)}]}])


@pytest.mark.parametrize("preset, fmt, says", [("tiny-vl", "mlx-q4", "this checkpoint has no vision tower"),
                                               ("tiny-qwen3-next", "mlx-q4", "Qwen3-Next has no vision tower")])
def test_images_need_a_tower(preset, fmt, says):
    model = qm.Model.load(cached_checkpoint(preset, fmt), backend="reference")
    with pytest.raises(InputError, match=says) as e:
        model.chat([user("Describe", png(1))], max_tokens=1)
    assert e.value.code == "unsupported_value"
    with pytest.raises(InputError, match=says):
        model.generate(f"{PLACEHOLDER} hi", images=[png(1)])
    assert len(model.prefix_cache) == 0


# ---- the server ----------------------------------------------------------------------------------------------
def test_server_takes_base64_images(vl, ref, tmp_path):
    """The openai client sends a base64 image (streamed and not): the answer is the library's. Corrupt data, an
    http URL and a local file without --allow-local-images get 400 in OpenAI's error shape; with the flag a
    file:// URL and a plain path work, also batched (parallel 2)."""
    openai = require("openai")
    model = qm.Model.load(vl, backend="reference")
    img = png(3)
    msgs = [user("What is in", img, "?")]
    want = ref.chat(msgs, max_tokens=4, temperature=0, enable_thinking=False, cache=False)
    args = dict(model=NAME, max_tokens=4, temperature=0, extra_body={"enable_thinking": False})
    with live_server(model, model_name=NAME) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(messages=msgs, **args)
        assert r.choices[0].message.content == want.content
        assert r.usage.prompt_tokens == want.stats["prompt_tokens"]
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=msgs, stream=True, **args) if c.choices)
        assert text == want.content
        path = tmp_path / "a.png"
        path.write_bytes(img)
        corrupt = data_url(png(3)[:40])                               # a PNG cut short
        bad = [(corrupt, "invalid_value", "data: URL image"),
               ("data:image/png;base64,iVBORw0KGgoAAAA", "invalid_value", "not valid base64"),
               ("http://example.com/a.png", "unsupported_value", "never fetches"),
               ("file://" + str(path), "unsupported_value", "--allow-local-images"),
               (str(path), "unsupported_value", "--allow-local-images")]
        for url, code, says in bad:
            m = [{"role": "user", "content": [{"type": "text", "text": "x"},
                                              {"type": "image_url", "image_url": {"url": url}}]}]
            with pytest.raises(openai.BadRequestError, match=says) as e:
                client.chat.completions.create(messages=m, **args)
            assert e.value.status_code == 400 and e.value.body["code"] == code
            assert e.value.body["param"] == "messages[0].content[1]"
    with live_server(model, model_name=NAME, allow_local_images=True, parallel=2) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        got = {}

        def ask(k, url):
            m = [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                              {"type": "image_url", "image_url": {"url": url}},
                                              {"type": "text", "text": "?"}]}]
            got[k] = client.chat.completions.create(messages=m, **args).choices[0].message.content

        ts = [threading.Thread(target=ask, args=(k, u)) for k, u in (("file", "file://" + str(path)),
                                                                     ("path", str(path)))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert got == {"file": want.content, "path": want.content}


# ---- the CLI -------------------------------------------------------------------------------------------------
def test_cli_image(vl, ref, tmp_path, capsys, monkeypatch):
    """``qwenmetal generate --chat --image`` and ``qwenmetal chat --image`` answer as `Model.chat`; a raw prompt
    takes --image with a placeholder in the prompt."""
    from qwenmetal.cli import main
    path = tmp_path / "a.png"
    path.write_bytes(png(4))
    want = ref.chat([{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                  {"type": "text", "text": "Describe."}]}],
                    max_tokens=4, temperature=0, enable_thinking=False, cache=False)
    common = ["--model", str(vl), "--backend", "reference", "--max-tokens", "4", "--temperature", "0"]
    assert main(["generate", *common, "--chat", "--no-thinking", "--prompt", "Describe.", "--image", str(path),
                 "--quiet"]) == 0
    assert capsys.readouterr().out == want.text + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Describe.\n/exit\n"))
    assert main(["chat", *common, "--no-thinking", "--image", str(path)]) == 0
    assert want.content in capsys.readouterr().out
    assert main(["generate", *common, "--prompt", f"{PLACEHOLDER}Describe.", "--image", str(path), "--quiet"]) == 0
    raw = list(ref.generate(f"{PLACEHOLDER}Describe.", images=[str(path)], max_tokens=4, temperature=0, cache=False))
    assert capsys.readouterr().out == "".join(o.text for o in raw) + "\n"


def test_disk_tier_continues_an_image_conversation(vl, tmp_path):
    """With a disk tier (`use_disk_cache`, the server's --cache-dir), a new process continues a conversation
    with an image from disk: the turn's file is keyed on the image's content, and its transcript comes back."""
    model = qm.Model.load(vl, backend="reference")
    model.use_disk_cache(tmp_path / "cache")
    msgs = [user("Describe", png(8))]
    r1 = model.chat(msgs, sampler=Scripted([65, 66, SPECIAL_TOKENS["<|im_end|>"]]), max_tokens=3,
                    enable_thinking=False)
    model.prefix_cache.disk.flush()
    fresh = qm.Model.load(vl, backend="reference")
    fresh.use_disk_cache(tmp_path / "cache")
    msgs2 = msgs + [r1.message, user("More?")]
    r2 = fresh.chat(msgs2, max_tokens=1, temperature=0, enable_thinking=False)
    assert r2.stats["cached_tokens"] == r1.stats["prompt_tokens"] + 2
    other = fresh.chat([user("Describe", png(9)), r1.message, user("More?")], max_tokens=1, temperature=0,
                       enable_thinking=False)
    assert other.stats["cached_tokens"] < r1.stats["prompt_tokens"] - 6       # not past the other image
