"""vit.seeds: one seed scheme, (run seed, purpose, keys), for every random draw of a run."""

from __future__ import annotations

from types import SimpleNamespace

from vit.seeds import Purpose, seed_for, step_seed


def test_each_purpose_draws_from_its_own_stream_for_the_same_keys():
    seeds = {purpose: seed_for(0, purpose, 1, 2) for purpose in Purpose}
    assert len(set(seeds.values())) == len(Purpose)
    assert all(0 <= seed < 2**32 for seed in seeds.values())
    assert seed_for(0, Purpose.SAMPLE, 1, 2) == seeds[Purpose.SAMPLE]  # a function of its arguments alone
    assert len({seed_for(run, Purpose.SAMPLE, epoch, index) for run in (0, 1) for epoch in (0, 1)
                for index in range(50)}) == 200  # fmt: skip


def test_a_training_batch_is_keyed_by_step_and_rank_and_its_place_in_an_accumulated_step():
    def trainer(step: int, rank: int, accumulate: int) -> SimpleNamespace:
        return SimpleNamespace(global_step=step, global_rank=rank, accumulate_grad_batches=accumulate)

    assert step_seed(3, Purpose.MIXUP, trainer(5, 1, 1), batch_idx=17) == seed_for(3, Purpose.MIXUP, 5, 1)
    first, second = (step_seed(3, Purpose.MIXUP, trainer(5, 1, 2), batch_idx=b) for b in (10, 11))
    assert first == seed_for(3, Purpose.MIXUP, 5, 1) and second == seed_for(3, Purpose.MIXUP, 5, 1, 1)
    assert step_seed(3, Purpose.DROPOUT, trainer(5, 1, 1), 0) != step_seed(3, Purpose.MIXUP, trainer(5, 1, 1), 0)
