"""`data.preload`: a warm spare's learner gets the corpus its zygote loaded, without touching the files again."""

import torch

from diloco_trainer.data import corpus as data
from diloco_trainer.config import DataConfig


def test_a_preloaded_corpus_is_what_load_corpus_returns_later_in_the_same_process(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(5):
        (folder / f"doc{i}.txt").write_text(f"document {i} " * 200)
    cfg = DataConfig(source="folder", path=str(folder), val_fraction=0.2)
    other = DataConfig(source="folder", path=str(folder), val_fraction=0.4)
    try:
        preloaded = data.preload(cfg, cache_dir=tmp_path / "cache")
        for f in folder.iterdir():  # gone from disk: a preloaded corpus is never read again
            f.unlink()
        assert data.load_corpus(cfg, cache_dir=tmp_path / "cache") is preloaded
        assert torch.equal(preloaded.train[:9], torch.tensor(list(b"document ")))
        # Any other argument is not preloaded: it is loaded (here: nothing is left to load).
        for args in ((other, tmp_path / "cache"), (cfg, tmp_path / "elsewhere")):
            try:
                data.load_corpus(*args)
            except ValueError as exc:
                assert "no text files" in str(exc)
            else:
                raise AssertionError(f"{args} was served from the preload")
    finally:
        data._PRELOADED.clear()
