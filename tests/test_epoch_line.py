"""Rank 0's epoch line keeps a tiny loss readable (trial: ``val_loss 0.0000`` on easy data)."""

from __future__ import annotations

from stoker.runtime.trainer import epoch_line


def test_a_tiny_loss_keeps_its_significant_digits():
    line = epoch_line(3, 12, 66, {"val_accuracy": 1.0, "val_loss": 2.345e-05}, 0.84)
    assert line == "epoch 3/12 step 66: val_accuracy 1.0000 val_loss 2.345e-05 (0.8 s)"


def test_a_usual_loss_reads_as_before():
    line = epoch_line(1, 8, 22, {"val_accuracy": 0.941, "val_loss": 0.21204}, 3.14)
    assert line == "epoch 1/8 step 22: val_accuracy 0.9410 val_loss 0.212 (3.1 s)"
