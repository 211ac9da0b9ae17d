"""``torchrun --nproc_per_node N -m megarl.trainer -c X.yaml [KEY=VALUE ...]``: one training rank
(:func:`megarl.trainer.main`)."""

if __name__ == "__main__":
    from megarl.parallel.fast_exit import exit_process
    from megarl.trainer import main

    exit_process(main())
