"""The evaluation data sets (LAMBADA, WikiText-2): where their files live and how they are
read (sources.py), and what a passage or an article is (lambada.py, wikitext.py), shared by
the HELM scenarios and `flexgen-helm eval`."""
