"""``python -m xl.babilong ckpt=RUN [key=value ...]``: score a trained run (:mod:`xl.babilong.score`)."""

from xl.babilong.score import main

if __name__ == "__main__":
    main()
