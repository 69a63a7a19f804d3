"""BABILong-style long-context question answering (Kuratov et al., 2024), generated offline.

The library: :mod:`~xl.babilong.world` and :mod:`~xl.babilong.tasks` write bAbI's stories (Weston et al., 2015,
tasks qa1–qa5) from their generator's rules; :mod:`~xl.babilong.lengths` reads lengths such as ``4k``;
:mod:`~xl.babilong.background` cuts any data source into sentences; :mod:`~xl.babilong.samples` hides a story's
facts in background text up to a length in the model's own tokens; :mod:`~xl.babilong.data` is the data group
``data=babilong``; :mod:`~xl.babilong.answers` is BABILong's scoring rule.

The application, the scoring command (:mod:`~xl.babilong.score`, run as ``xl.babilong``'s ``__main__``, and
:mod:`~xl.babilong.report`), scores a trained run. The library never imports the application.
"""
