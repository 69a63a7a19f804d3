"""Train a Transformer-XL: ``python train.py [group=option] [key=value ...]`` (Hydra). The command is
:mod:`xl.train`; ``xl-train`` is the same."""

from xl.train import main

if __name__ == "__main__":
    main()
