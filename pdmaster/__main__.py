from pdmaster.main import main

main()
