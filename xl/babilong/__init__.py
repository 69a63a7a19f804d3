"""The BABILong scoring command: scores a trained run on BABILong-style tasks (:mod:`xl.babilong.score`, run as
this package's ``__main__``; its report :mod:`xl.babilong.report`). The tasks and samples are the library's
(:mod:`xl.data.babilong`)."""
