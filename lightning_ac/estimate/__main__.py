from lightning_ac.estimate.cli import main

main()
