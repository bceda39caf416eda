"""Monitors (DeepSpeed's ``deepspeed.monitor``): TensorBoard, CSV files, Weights & Biases and Comet
behind ``MonitorMaster``; the events the engine writes each optimizer step (``events.py``); and
``zerospeed plot`` drawing a CSV run (``plot.py``). See docs/monitor.md."""

from zerospeed.monitor.base import Event, Monitor
from zerospeed.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from zerospeed.monitor.monitor import CometMonitor, MonitorMaster, TensorBoardMonitor, WandbMonitor, csvMonitor

__all__ = ["CometMonitor", "DeepSpeedMonitorConfig", "Event", "Monitor", "MonitorMaster", "TensorBoardMonitor",
           "WandbMonitor", "csvMonitor", "get_monitor_config"]
