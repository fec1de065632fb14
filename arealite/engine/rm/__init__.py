"""Reward-model training: a scalar head scored at each sequence's last token, trained with the
Bradley-Terry pairwise loss on packed chosen/rejected pairs (reward_model.py); preference rows
and the synthetic arithmetic preferences (preference_data.py).
Part of arealite.engine: imports arealite.engine, arealite.api and arealite.utils."""
