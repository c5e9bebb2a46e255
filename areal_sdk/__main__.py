from areal_sdk.cli import main

main()
