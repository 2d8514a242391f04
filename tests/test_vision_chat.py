

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
