"""``torchrun -m megarl.train``: the same training rank as ``-m megarl.trainer``
(:func:`megarl.trainer.main`), kept for existing launch scripts."""

if __name__ == "__main__":
    from megarl.parallel.fast_exit import exit_process
    from megarl.trainer import main

    exit_process(main())
