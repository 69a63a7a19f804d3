"""BABILong-style long-context question answering (Kuratov et al., 2024), generated offline: the library part.

:mod:`~xl.data.babilong.world` and :mod:`~xl.data.babilong.tasks` write bAbI's stories (Weston et al., 2015, tasks
qa1–qa5) from their generator's rules; :mod:`~xl.data.babilong.lengths` reads lengths such as ``4k``;
:mod:`~xl.data.babilong.background` cuts any data source into sentences; :mod:`~xl.data.babilong.samples` hides a
story's facts in background text up to a length in the model's own tokens; :mod:`~xl.data.babilong.data` is the data
group ``data=babilong``; :mod:`~xl.data.babilong.answers` is BABILong's scoring rule. The scoring command is
:mod:`xl.babilong`.
"""
