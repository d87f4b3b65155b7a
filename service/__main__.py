from rnnserve.service.cli import main

main()
