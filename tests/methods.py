"""Per-method run-config additions that let every method run on tiny data in tests."""

STREAM = {"fedade-rounds-per-step": 1, "fedade-batch": 20, "fedade-pretrain-epochs": 1,
          "train-samples": 2000, "min-partition-size": 6}

SSL = {"probe-every": 2, "probe-epochs": 1, "local-test-fraction": 0.0, "train-samples": 300}

EXTRA = {
    "fedlc": {"partition": "pathological:2"},
    "fedrs": {"partition": "pathological:2"},
    "fedsam": {"partition": "pathological:2"},
    "fedvls": {"partition": "pathological:2"},
    "fedftg": {"fedftg-iterations": 1, "fedftg-student-steps": 1},  # the server's distillation is the cost
    # FedConcat: the encoder stage in round 1, the classifier after (a resume crosses the stages)
    "fedconcat": {"fedconcat-encoder-rounds": 1, "fedconcat-clusters": 2, "partition": "pathological:2"},
    "fedcc": {"public-fraction": 0.1, "partition": "pathological:1", "distill-epochs": 1},
    "feddf": {"public-fraction": 0.1, "partition": "pathological:1", "distill-epochs": 1},
    "fedmd": {"public-fraction": 0.1, "partition": "pathological:1", "distill-epochs": 1},
    "fedct": {"public-fraction": 0.1, "partition": "pathological:1"},
    # self-supervised: two augmented views per sample, the costliest local step here; 300 samples
    "fedx": {**SSL, "fedx-base": "simclr"},
    **{m: SSL for m in ("fedsimclr", "fedbyol", "fedu", "fedmoco", "fedprotocl", "moon-unsup")},
    # seeded noise: the resume and determinism tests compare two runs' metrics
    "fedxds": {"fedxds-warmup-rounds": 1, "fedxds-share-fraction": 0.2, "fedxds-noise": "seeded"},
    "fedfed": {"fedxds-warmup-rounds": 1, "fedxds-share-fraction": 0.2, "fedxds-noise": "seeded"},
    **{m: STREAM for m in ("fedade", "fedpoe")},
    "atlas": {**STREAM, "atlas-grid": 10.0},  # 4 base learners (1e-5 ... 1e-2), not 8
    **{m: {"num-models": 2, "local-test-fraction": 0.25, "partition": "pathological:2"}
       for m in ("fedfew", "ifca", "fedsoft", "fedrep", "ditto", "apfl", "fedamp", "local", "fedavg-ft")},
    # CFL: splits in round 1 (3 clients), so that a resumed round 2 is served from restored clusters
    "cfl": {"local-test-fraction": 0.25, "partition": "pathological:2", "cfl-warmup": 0,
            "cfl-eps1": 1e6, "cfl-eps2": 1e-9},
}
