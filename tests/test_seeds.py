"""vit.seeds: one seed scheme, (run seed, purpose, keys), for every random draw of a run."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import vit.data.sampling as sampling
from vit.data.process import SamplerState
from vit.data.sampling import ResumableSampler
from vit.seeds import Purpose, sample_seeds, seed_for, step_seed


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


def test_a_sampler_yields_each_index_with_its_sample_seed_drawn_a_run_at_a_time(monkeypatch):
    monkeypatch.setattr(sampling, "SEED_RUN", 7)  # runs that end mid-epoch
    sampler = ResumableSampler(range(30), seed=5, num_replicas=1, rank=0)
    sampler.set_epoch(2)
    pairs = list(sampler)
    assert sorted(i for i, _ in pairs) == list(range(30))
    assert all(seed == seed_for(5, Purpose.SAMPLE, 2, i) for i, seed in pairs)
    assert sample_seeds(5, 2, [3, 1]) == [(i, seed_for(5, Purpose.SAMPLE, 2, i)) for i in (3, 1)]


def test_a_copy_of_a_sampler_given_its_state_yields_the_same_pairs_from_the_resume_position():
    """What a loader sends its data process each epoch: the copy made before the epoch, resume and
    seed changed, yields what the sampler itself yields."""
    sampler = ResumableSampler(range(40), seed=0, num_replicas=2, rank=1)
    copy = pickle.loads(pickle.dumps(sampler))  # the data process's, made when it started
    sampler.set_epoch(3)
    sampler.seed, sampler.resume_epoch, sampler.resume_position = 11, 3, 6
    state = SamplerState.of(sampler)
    assert state == SamplerState(epoch=3, seed=11, resume_epoch=3, resume_position=6)
    pickle.loads(pickle.dumps(state)).apply(copy)
    expected = list(sampler)
    assert list(copy) == expected and len(expected) == 20 - 6
    assert list(sampler)[:6] == [(i, seed_for(11, Purpose.SAMPLE, 3, i)) for i in sampler.epoch_order()[:6]]
