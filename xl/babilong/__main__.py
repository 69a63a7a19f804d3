"""The scoring command: score a trained run on BABILong-style tasks (:mod:`xl.babilong.score`)."""

from xl.babilong import main

if __name__ == "__main__":
    main()
