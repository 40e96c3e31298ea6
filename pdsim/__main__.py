from pdsim.main import main

main()
